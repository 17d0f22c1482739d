"""Batches whose shapes change from step to step: the ranks' side, and the reference.

A small float64 language model whose blocks take any batch size and sequence
length (positions are cut to the sequence), trained on a list of step shapes
that changes the sequence length, the batch size and whether it divides into
the micro-batches, and comes back to shapes seen before. Every rank returns
its losses, the gradients of each step and how many layout messages each step
sent or read; the parent compares them with one process on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.runtime import Pipeline

WIDTH = 8
VOCAB = 11
MAX_SEQ = 16
HEADS = 2
IGNORED = -100

TRAIN_SHAPES = [(8, 6), (8, 10), (6, 6), (8, 6), (5, 10), (6, 6)]
"""(batch size, sequence length) of each step: with 4 micro-batches, 6 and 5 rows split
unevenly; steps 3 and 5 repeat shapes seen before."""
EVAL_SHAPES = [(7, 9), (7, 9)]
"""Evaluation on a shape training never saw, then again."""


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.randn(MAX_SEQ, WIDTH) * 0.1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: Tensor) -> Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return h + self.down(torch.tanh(self.up(h)))


class CutByValue(nn.Module):
    """Keeps the first ``ids[0, 0] + 1`` positions: an output shape that depends on the
    values (what a pipeline cannot learn from the input shape)."""

    def forward(self, ids: Tensor) -> Tensor:
        return ids[:, : int(ids[0, 0]) + 1]


class PooledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(h.mean(dim=1))


def build_blocks() -> list[nn.Module]:
    """Embedding, 4 layers and a head (6 blocks), float64, from a fixed seed."""
    torch.manual_seed(4321)
    blocks: list[nn.Module] = [Embed(), *(Layer() for _ in range(4)), nn.Linear(WIDTH, VOCAB)]
    return [b.double() for b in blocks]


def build_value_dependent() -> list[nn.Module]:
    """A cut by value, the embedding, a layer and a pooled head (one prediction per row)."""
    torch.manual_seed(4321)
    blocks: list[nn.Module] = [CutByValue(), Embed(), Layer(), PooledHead()]
    return [b.double() for b in blocks]


def value_dependent_batch(first: int, second: int) -> tuple[Tensor, Tensor]:
    """4 rows of 6 ids; the first rows of the two micro-batches start with ``first`` and
    ``second``; one target per row."""
    ids, targets = make_batch(9, 4, 6)
    ids[0, 0], ids[2, 0] = first, second
    return ids, targets[:, 0]


def mean_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def sum_and_count(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The documented loss for an exact token mean: the sum over the tokens that count,
    and their number."""
    total = F.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORED, reduction="sum"
    )
    return total, (targets != IGNORED).sum()


def token_mean(logits: Tensor, targets: Tensor) -> Tensor:
    """The reference of :func:`sum_and_count`: the mean over every token that counts."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORED)


def make_batch(step: int, rows: int, seq: int, padded: bool = False) -> tuple[Tensor, Tensor]:
    """Token ids and next-token targets; ``padded``: a few rows end early (ignored)."""
    gen = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    if padded:
        for r in range(rows):
            ends = int(torch.randint(1, seq + 1, (1,), generator=gen))
            targets[r, ends:] = IGNORED
    return ids, targets


def reference(
    shapes: list[tuple[int, int]], loss: Any = mean_loss, padded: bool = False
) -> dict[str, Any]:
    """One process on each whole batch: the loss and gradients of every step (no update)."""
    model = nn.Sequential(*build_blocks())
    losses, grads = [], []
    for step, (rows, seq) in enumerate(shapes):
        ids, targets = make_batch(step, rows, seq, padded)
        value = loss(model(ids), targets)
        value.backward()
        losses.append(float(value.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    return {"losses": losses, "grads": grads}


def reference_eval(shapes: list[tuple[int, int]]) -> list[Tensor]:
    model = nn.Sequential(*build_blocks())
    with torch.no_grad():
        return [model(make_batch(100 + i, rows, seq)[0]) for i, (rows, seq) in enumerate(shapes)]


def _steps(
    pipe: Pipeline, shapes: list[tuple[int, int]], padded: bool = False, dp: int = 1
) -> dict[str, Any]:
    losses, grads, messages, memory = [], [], [], []
    for step, (rows, seq) in enumerate(shapes):
        ids, targets = make_batch(step, rows, seq, padded)
        if dp > 1:
            ids = torch.tensor_split(ids, dp)[pipe.dp_rank]
            targets = torch.tensor_split(targets, dp)[pipe.dp_rank]
        losses.append(pipe.step(ids, targets))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        messages.append(pipe.step_times.layout_messages)
        memory.append(pipe.memory_stats()["activations"])
        pipe.zero_grad()
    return {"losses": losses, "grads": grads, "messages": messages, "memory": memory}


def _evaluate(pipe: Pipeline) -> dict[str, Any]:
    outputs, messages = [], []
    for i, (rows, seq) in enumerate(EVAL_SHAPES):
        ids, targets = make_batch(100 + i, rows, seq)
        outputs.append(pipe.eval_step(ids))
        messages.append(pipe.step_times.layout_messages)
    ids, targets = make_batch(100, *EVAL_SHAPES[0])
    return {"outputs": outputs, "messages": messages, "loss": pipe.eval_step(ids, targets)}


FAMILIES = ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v", "chimera"]


def shapes_session(families: list[str], timeout: float) -> dict[str, Any]:
    """Every family over :data:`TRAIN_SHAPES`, then evaluation, a sum-and-count loss,
    too few rows and a value-dependent output shape."""
    out: dict[str, Any] = {}
    for name in families:
        with Pipeline(
            build_blocks(), mean_loss, schedule=name, n_microbatches=4, device="cpu",
            timeout=timeout,
        ) as pipe:  # fmt: skip
            out[name] = _steps(pipe, TRAIN_SHAPES)
            if name == "1f1b":
                out["eval"] = _evaluate(pipe)
    with Pipeline(
        build_blocks(), sum_and_count, schedule="1f1b", n_microbatches=4, device="cpu",
        timeout=timeout,
    ) as pipe:  # fmt: skip
        out["sum and count"] = _steps(pipe, TRAIN_SHAPES, padded=True)
        try:
            pipe.step(*make_batch(0, 3, 6))
        except Exception as exc:
            out["too few rows"] = (type(exc).__name__, str(exc))
    out["value dependent"] = _value_dependent(timeout)
    return out


def _value_dependent(timeout: float) -> dict[str, Any]:
    """A block whose output length depends on the values: the step fails on every rank,
    naming the boundary, and the pipeline goes on with values that keep the length."""
    with Pipeline(
        build_value_dependent(), F.cross_entropy, schedule="1f1b", n_microbatches=2,
        partition=[2, 2], device="cpu", timeout=timeout,
    ) as pipe:  # fmt: skip
        try:
            pipe.step(*value_dependent_batch(2, 4))
            error: tuple[str, str] | None = None
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        # Values that cut both micro-batches as the first one was: the layout holds.
        loss = pipe.step(*value_dependent_batch(2, 2))
        return {"error": error, "loss after": loss}


def data_parallel_session(timeout: float) -> dict[str, Any]:
    """Two copies of a 2-rank pipeline on parts of uneven size (9 rows: 5 and 4; 7: 4
    and 3), a mean and a sum-and-count loss."""
    out: dict[str, Any] = {}
    for label, loss, padded in (("mean", mean_loss, False), ("sum and count", sum_and_count, True)):
        with Pipeline(
            build_blocks(), loss, schedule="1f1b", n_microbatches=2, data_parallel=2,
            device="cpu", timeout=timeout,
        ) as pipe:  # fmt: skip
            out[label] = _steps(pipe, DP_SHAPES, padded=padded, dp=2)
    out["rank"] = dist.get_rank()
    return out


DP_SHAPES = [(9, 6), (7, 10), (9, 6)]
LR = 0.01


def sharded_session(schedules: list[str], timeout: float) -> dict[str, Any]:
    """Two copies of a 2-rank pipeline with sharded parameters (2BP, AdamW through
    ``pipe.shard_optimizer``) on :data:`DP_SHAPES`, parts of uneven size: each step's loss
    and the parameters after its update."""
    out: dict[str, Any] = {}
    for name in schedules:
        with Pipeline(
            build_blocks(), mean_loss, schedule=name, n_microbatches=2, data_parallel=2,
            two_bp=True, shard_parameters=True, device="cpu", timeout=timeout,
        ) as pipe:  # fmt: skip
            optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
            losses, states = [], []
            for step, (rows, seq) in enumerate(DP_SHAPES):
                ids, targets = make_batch(step, rows, seq)
                ids = torch.tensor_split(ids, 2)[pipe.dp_rank]
                targets = torch.tensor_split(targets, 2)[pipe.dp_rank]
                losses.append(pipe.step(ids, targets))
                optimizer.step()
                optimizer.zero_grad()
                states.append(pipe.state_dict())
            out[name] = {"losses": losses, "states": states}
    return out


def trained_reference(shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """One process on each whole batch, AdamW after each: losses and parameters."""
    model = nn.Sequential(*build_blocks())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, states = [], []
    for step, (rows, seq) in enumerate(shapes):
        ids, targets = make_batch(step, rows, seq)
        value = mean_loss(model(ids), targets)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(value.detach()))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "states": states}
