"""What the loss-scaling cases run on every rank of a launched group (float16 autocast).

Two families, each compared by the parent with ``torch.amp.GradScaler`` on one process:

* :func:`confined`: 2 stages x 2 copies of a small MLP whose first block has a bias that
  overflows float16 alone (:class:`Spike`); at one step only copy 1's targets are large
  enough for it to overflow, so the overflow starts on one rank, and with
  ``pipe.shard_optimizer`` it lands in one rank's shard of the reduced gradient;
* :func:`schedule_case`: the model whose head is tied to its embedding
  (``runtime_models`` "tied"), under Chimera, DualPipe and recomputation, from a scale
  so large that the first step overflows everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grad_scaler_workers import scaled_steps
from runtime_models import build_blocks as build_model_blocks
from runtime_models import loss_fn as model_loss_fn
from runtime_models import make_batch as make_model_batch
from twobp.runtime import GradScaler, PeerError, Pipeline

CONFINED_TIMEOUT = 20.0
"""Seconds a rank of :func:`confined` waits on a peer: ranks that disagreed on a skip fail
in this time instead of hanging (a sharded optimizer's gather of the updated shards waits
for a peer that did not step)."""

# -- an overflow on one rank --------------------------------------------------------------

WIDTH = 16
N_MB = 4
PART = 8
"""Samples per data-parallel copy."""
SPIKE = 1024.0
"""A power of two: dividing by it and multiplying again is exact in float16."""
HOT = 400.0
"""What copy 1's targets are multiplied by at :data:`HOT_STEP`."""
HOT_STEP = 1
CONFINED_STEPS = 5
CONFINED_LR = 0.2
CONFINED_SCALER: dict[str, Any] = {"init_scale": 256.0, "growth_interval": 2}
"""A scale 16 times below the first overflow of the ordinary batches (2**12 on one
process) and 16 times above that of the hot one (2**4), which overflows nothing but the
spiked bias below 2**13."""


class Spike(nn.Module):
    """A linear layer plus a bias whose float16 gradient alone passes through ``SPIKE``.

    The forward divides the bias by ``SPIKE`` and multiplies it again (in float16, exactly),
    so it is a plain bias with an ordinary gradient; the backward multiplies that gradient
    by ``SPIKE`` in float16 before dividing it again, so it overflows (and only it) at a
    scale ``SPIKE`` times lower than any other gradient of the model does.
    """

    def __init__(self) -> None:
        super().__init__()
        # Registered first: it lies at one end of its stage's flat buffer, so under
        # shard_optimizer it falls within one rank's shard.
        self.spiked = nn.Parameter(torch.zeros(WIDTH))
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        bias = (self.spiked.to(torch.float16) / SPIKE) * SPIKE
        return torch.tanh(self.linear(x) + bias)


def spike_blocks() -> list[nn.Module]:
    """Four float32 blocks, the same on every rank: :class:`Spike`, then an MLP."""
    torch.manual_seed(0)
    return [
        Spike(),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Linear(WIDTH, 4),
    ]


def global_batch(step: int) -> tuple[Tensor, Tensor]:
    """The batch of both copies at ``step`` (copy ``d`` takes rows ``d * PART``...);
    at :data:`HOT_STEP` copy 1's targets are :data:`HOT` times larger."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * PART, WIDTH, generator=generator)
    y = torch.tanh(x[:, :4] * 2.0)
    if step == HOT_STEP:
        y[PART:] *= HOT
    return x, y


def _state(pipe: Pipeline) -> dict[str, Tensor]:
    return {n: t.clone() for n, t in pipe.state_dict().items()}


def confined(sharded: bool) -> dict[str, Any]:
    """SGD steps of 2 stages x 2 copies; at :data:`HOT_STEP` copy 1 overflows the spiked bias.

    ``sharded``: the optimizer of ``pipe.shard_optimizer`` (ZeRO-1). Returns per step the
    loss, the scale after ``update``, whether the step was skipped and whether a gradient
    this rank's optimizer holds was not finite before ``unscale_``; whether the hot step
    left this rank's parameters as they were; the final parameters; and the error a peer
    raised, if any (a rank that stepped while another skipped).
    """
    torch.set_num_threads(1)
    scaler = GradScaler(**CONFINED_SCALER)
    pipe = Pipeline(
        spike_blocks(),
        F.mse_loss,
        n_microbatches=N_MB,
        device="cpu",
        timeout=CONFINED_TIMEOUT,
        autocast=torch.float16,
        data_parallel=2,
        grad_scaler=scaler,
    )
    optimizer = (
        pipe.shard_optimizer(torch.optim.SGD, lr=CONFINED_LR)
        if sharded
        else torch.optim.SGD(pipe.parameters(), lr=CONFINED_LR)
    )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    out: dict[str, Any] = {"losses": [], "scales": [], "skipped": [], "not_finite": [], "error": ""}
    try:
        for step in range(CONFINED_STEPS):
            before = _state(pipe)
            x, y = global_batch(step)
            out["losses"].append(pipe.step(x[part], y[part]))
            out["not_finite"].append(
                any(p.grad is not None and not torch.isfinite(p.grad).all() for p in held)
            )
            scaler.step(optimizer)
            out["skipped"].append(scaler.last_step_skipped)
            scaler.update()
            out["scales"].append(scaler.get_scale())
            pipe.zero_grad()
            if step == HOT_STEP:
                after = _state(pipe)
                out["unchanged"] = all(torch.equal(after[n], t) for n, t in before.items())
        out["state"] = _state(pipe)
    except PeerError as error:
        out["error"] = f"{type(error).__name__}: {error}"
        return out
    pipe.close()
    return out


# -- schedules, a tied weight, recomputation --------------------------------------------------

MODEL = "tied"
CASE_STEPS = 4
CASE_LR = 0.5
CASE_SCALER: dict[str, Any] = {
    "init_scale": 2.0**24,
    "backoff_factor": 2.0**-12,
    "growth_interval": 1,
}
"""The first step overflows everywhere (the model's gradients overflow float16 from
2**17 on one process, 2**19 per micro-batch); the scale then falls to 2**12 and grows
to 2**14 by the last step, 8 times below the first overflow."""


def case_batch(step: int, size: int) -> tuple[Any, Tensor]:
    return make_model_batch(MODEL, step, size)


def case_blocks() -> list[nn.Module]:
    """The tied model in float32 (the head's weight is the embedding's)."""
    return [b.float() for b in build_model_blocks(MODEL)]


def schedule_case(schedule: str, options: dict[str, Any]) -> dict[str, Any]:
    """SGD steps of the tied model under ``schedule``; each copy takes its part of the batch.

    Returns the losses, the scales after ``update``, the skips, the global gradient norm
    after ``unscale_`` (``pipe.clip_grad_norm_``) and this rank's final parameters.
    """
    torch.set_num_threads(1)
    scaler = GradScaler(**CASE_SCALER)
    pipe = Pipeline(
        case_blocks(),
        model_loss_fn(MODEL),
        schedule,
        device="cpu",
        timeout=60.0,
        autocast=torch.float16,
        grad_scaler=scaler,
        **options,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=CASE_LR)
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)

    def own(step: int) -> tuple[Any, Tensor]:
        (ids, keep), targets = case_batch(step, PART * pipe.dp_size)
        return (ids[part], keep[part]), targets[part]

    out: dict[str, Any] = scaled_steps(pipe, scaler, optimizer, map(own, range(CASE_STEPS)))
    out["state"] = _state(pipe)
    pipe.close()
    return out


def session(cases: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Every case of the test module on this rank, keyed by its text; the confined
    overflow with a sharded optimizer last (a rank that disagreed ends the group)."""
    out: dict[str, Any] = {repr(c): schedule_case(*c) for c in cases}
    out["plain"] = confined(False)
    out["sharded"] = confined(True)
    return out
