"""Small float64 models and data for the runtime tests, built the same on every process.

Each model is a list of 10 blocks built from a fixed seed, so that every rank
and the single-process reference start from identical weights:

* ``mlp``: linear layers with tanh and one layer norm; mean squared error.
* ``transformer``: embedding, 8 pre-norm layers with
  ``F.scaled_dot_product_attention``, and a head; the blocks pass a tuple
  ``(hidden, keep_mask)`` whose boolean mask gets no gradient; cross-entropy.
* ``conv``: convolutions with BatchNorm and a linear head; cross-entropy. Its
  reference runs the micro-batches one by one, as BatchNorm statistics depend
  on the micro-batch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.partition.profiler import BlockCost
from twobp.runtime.base.group import LAUNCHER_VARIABLES

MODELS = ("mlp", "transformer", "conv")
N_BLOCKS = 10
WIDTH = 8
VOCAB = 16
SEQ = 6
HEADS = 2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        ids, keep = batch
        return self.tokens(ids) + self.positions, keep


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.RMSNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, keep = batch
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        mask = causal & keep[:, None, None, :]
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, d))
        h = h + self.down(F.gelu(self.up(self.norm2(h))))
        return h, keep


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        h, _ = batch
        return self.out(self.norm(h))


def _conv_block(c_in: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c_in, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())


def build_blocks(name: str) -> list[nn.Module]:
    """The 10 blocks of model ``name``, float64, from a fixed seed."""
    torch.manual_seed(1234)
    blocks: list[nn.Module]
    if name == "mlp":
        blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(N_BLOCKS - 1)]
        blocks[3] = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh())
        blocks.append(nn.Linear(WIDTH, 4))
    elif name in ("transformer", "tied"):
        blocks = [Embed(), *(Layer() for _ in range(N_BLOCKS - 2)), Head()]
        if name == "tied":  # the output head reads the token embedding, as GPT-2 does
            blocks[-1].out.weight = blocks[0].tokens.weight
    elif name == "conv":
        blocks = [_conv_block(3), *(_conv_block(4) for _ in range(N_BLOCKS - 3))]
        blocks += [nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(4, 5)]
    else:
        raise ValueError(name)
    return [b.double() for b in blocks]


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def loss_fn(name: str) -> Callable[[Any, Any], Tensor]:
    """The loss of model ``name`` (mean over a micro-batch)."""
    losses = {"mlp": F.mse_loss, "transformer": _lm_loss, "tied": _lm_loss, "conv": F.cross_entropy}
    return losses[name]


def make_batch(name: str, step: int, batch_size: int) -> tuple[Any, Tensor]:
    """Inputs and targets of step ``step`` (deterministic)."""
    gen = torch.Generator().manual_seed(100 + step)
    if name == "mlp":
        x = torch.randn(batch_size, WIDTH, generator=gen, dtype=torch.float64)
        return x, torch.randn(batch_size, 4, generator=gen, dtype=torch.float64)
    if name in ("transformer", "tied"):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
        keep = torch.rand(batch_size, SEQ, generator=gen) > 0.3
        keep[:, 0] = True  # every query sees at least one key
        return (ids, keep), torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    x = torch.randn(batch_size, 3, 8, 8, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 5, (batch_size,), generator=gen)


def per_microbatch(name: str) -> bool:
    """True if the reference must run micro-batch by micro-batch (BatchNorm)."""
    return name == "conv"


def _chunks(batch: Any, n: int) -> list[Any]:
    if isinstance(batch, tuple):
        return list(zip(*(t.chunk(n) for t in batch), strict=True))
    return list(batch.chunk(n))


def reference_step(model: nn.Module, name: str, inputs: Any, targets: Tensor, n_mb: int) -> float:
    """One single-process forward and backward; returns the mean loss."""
    loss_of = loss_fn(name)
    if not per_microbatch(name):
        loss = loss_of(model(inputs), targets)
        loss.backward()
        return float(loss.detach())
    total = 0.0
    for x, y in zip(_chunks(inputs, n_mb), _chunks(targets, n_mb), strict=True):
        loss = loss_of(model(x), y)
        (loss / n_mb).backward()
        total += float(loss.detach()) / n_mb
    return total


N_STEPS = 3
LR = 1e-2


def replicas_running_statistics(
    model: nn.Module, inputs: Any, n_mb: int, replicas: int, before: dict[str, Tensor]
) -> None:
    """Set ``model``'s buffers to what ``replicas`` copies of it hold after one step.

    The ``n_mb`` micro-batches of ``inputs`` fall to the copies in contiguous
    groups, in order (data-parallel copy by copy, and within a copy Chimera's
    down pipeline before its up one). Each copy starts from the buffers
    ``before`` the step and updates them on its own micro-batches (BatchNorm in
    training mode); the floating-point buffers are then averaged over the
    copies, as the documentation says; the others (a count of batches) are
    those of one copy, which all count alike.
    """
    groups = _chunks(inputs, n_mb)
    per_copy = n_mb // replicas
    ends: list[dict[str, Tensor]] = []
    with torch.no_grad():
        for copy in range(replicas):
            model.load_state_dict(before, strict=False)
            for x in groups[copy * per_copy : (copy + 1) * per_copy]:
                model(x)
            ends.append({n: b.clone() for n, b in model.named_buffers()})
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            buffer.copy_(torch.stack([end[name] for end in ends]).mean(dim=0))
        else:
            buffer.copy_(ends[0][name])


def train_reference(name: str, n_mb: int, batch_size: int, replicas: int = 1) -> dict[str, Any]:
    """Losses, first-step gradients and final state of 3 AdamW steps on one process.

    With ``replicas`` > 1 the buffers are those of that many copies of every stage
    (:func:`replicas_running_statistics`); losses, gradients and parameters do not
    depend on them.
    """
    model = nn.Sequential(*build_blocks(name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(N_STEPS):
        inputs, targets = make_batch(name, step, batch_size)
        before = {n: b.clone() for n, b in model.named_buffers()}
        losses.append(reference_step(model, name, inputs, targets, n_mb))
        if replicas > 1 and before:
            replicas_running_statistics(model, inputs, n_mb, replicas, before)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state}


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread (the machine is shared; threads contend), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


needs_no_process_group = pytest.mark.skipif(
    dist.is_initialized() or any(v in os.environ for v in LAUNCHER_VARIABLES),
    reason="needs a process without a process group",
)
"""Skips a test when this process already belongs to a group (the pipeline
under test would join it instead of making its own)."""


def clipped_adamw_reference(
    model: str,
    batches: list[list[tuple[Any, Tensor]]],
    lr: float,
    clip: float,
    halve_lr_each_step: bool = False,
) -> dict[str, Any]:
    """Plain PyTorch in one process: ``nn.Sequential`` of ``model``'s blocks, trained by
    AdamW over ``batches`` (per optimizer step, the batches whose gradients it accumulates),
    the gradients clipped to ``clip`` before each step; with ``halve_lr_each_step``, a
    ``StepLR`` halving the rate after each. Each loss, each clipped norm and the state, as
    :func:`assert_trained_as` compares them."""
    net = nn.Sequential(*build_blocks(model))
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    losses, norms = [], []
    for step_batches in batches:
        for inputs, targets in step_batches:
            loss = loss_fn(model)(net(inputs), targets)
            loss.backward()
            losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        optimizer.step()
        if halve_lr_each_step:
            scheduler.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "state": net.state_dict()}


def assert_trained_as(
    reference: dict[str, Any], got: dict[str, Any], tol: float, where: Any
) -> None:
    """A rank's ``losses``, clipped ``norms`` and ``state`` (each parameter it holds, by
    name) equal those of the single-process ``reference`` within ``tol``."""
    for ours, want in zip(got["losses"], reference["losses"], strict=True):
        assert abs(ours - want) <= tol, (where, "loss", ours, want)
    for ours, want in zip(got["norms"], reference["norms"], strict=True):
        assert abs(ours - want) <= tol, (where, "norm", ours, want)
    assert got["state"], where
    for name, value in got["state"].items():
        torch.testing.assert_close(
            value, reference["state"][name], rtol=0, atol=tol, msg=f"{where} {name}"
        )


def costs_in_proportion(
    profiled: list[list[BlockCost]],
    real_profile: Callable[..., list[BlockCost]],
    weights: Sequence[float],
) -> Callable[..., list[BlockCost]]:
    """A stand-in for ``profile_blocks`` that runs the real profile and returns it with
    each block's ``F + I + W`` set to its weight (its ``F``, ``I``, ``W`` and ``B`` kept
    in their measured proportions), recording what it returned in ``profiled``: what a
    pipeline then solves does not turn on how busy the machine was while it measured."""

    def profile(*args: Any, **kwargs: Any) -> list[BlockCost]:
        measured = real_profile(*args, **kwargs)
        assert len(measured) == len(weights), (len(measured), len(weights))
        costs = []
        for c, weight in zip(measured, weights, strict=True):
            scale = weight / c.total
            costs.append(
                dataclasses.replace(
                    c,
                    forward=c.forward * scale,
                    backward_input=c.backward_input * scale,
                    backward_weight=c.backward_weight * scale,
                    backward_full=c.backward_full * scale,
                    forward_full=None if c.forward_full is None else c.forward_full * scale,
                )
            )
        profiled.append(costs)
        return costs

    return profile
