"""What the loss-scaling tests run on every rank of a launched group (float16 autocast)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.runtime import GradScaler, NonFiniteLossError, Pipeline

WIDTH = 16
N_MB = 4
PART = 8
"""Samples per data-parallel copy."""
BLOW_UP = 1000.0


class Amplified(nn.Module):
    """Two linear layers whose inner gradient is ``BLOW_UP`` times the block's output gradient.

    The output is scaled down by the second layer's small weights and up again by
    ``BLOW_UP``, so the forward is of ordinary size; the backward multiplies the
    float16 gradient by ``BLOW_UP``, which overflows at large loss scales.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.outer = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.outer.weight.mul_(1.0 / BLOW_UP)
            self.outer.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.outer(torch.tanh(self.inner(x))) * BLOW_UP)


def build_blocks(amplified: bool) -> list[nn.Module]:
    """Four float32 blocks, the same on every rank; the first is :class:`Amplified` if asked."""
    torch.manual_seed(0)
    first: nn.Module = (
        Amplified() if amplified else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    )
    return [
        first,
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Linear(WIDTH, 4),
    ]


def make_batch(step: int, size: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size, WIDTH, generator=generator)
    return x, torch.tanh(x[:, :4] * 2.0)


def _pipeline(amplified: bool, scaler: GradScaler, **options: Any) -> Pipeline:
    return Pipeline(
        build_blocks(amplified),
        F.mse_loss,
        n_microbatches=N_MB,
        device="cpu",
        timeout=60.0,
        autocast=torch.float16,
        data_parallel=2,
        grad_scaler=scaler,
        **options,
    )


def _own(pipe: Pipeline, step: int) -> tuple[Tensor, Tensor]:
    x, y = make_batch(step, PART * pipe.dp_size)
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    return x[part], y[part]


def overflow(steps: int) -> dict[str, Any]:
    """Train the amplified model from a large scale: which parameters overflowed here, and
    what every rank decided."""
    torch.set_num_threads(1)
    scaler = GradScaler(init_scale=2.0**16, growth_interval=1000)
    pipe = _pipeline(True, scaler)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    losses, scales, skipped, not_finite = [], [], [], []
    for step in range(steps):
        losses.append(pipe.step(*_own(pipe, step)))
        not_finite.append(
            sorted(n for n, p in pipe.named_parameters() if not torch.isfinite(p.grad).all())
        )
        scaler.unscale_(optimizer)
        pipe.clip_grad_norm_(1.0)
        scaler.step(optimizer)
        skipped.append(scaler.last_step_skipped)
        scaler.update()
        scales.append(scaler.get_scale())
        pipe.zero_grad()
    pipe.close()
    return {
        "losses": losses,
        "scales": scales,
        "skipped": skipped,
        "not_finite": not_finite,
    }


def scaled_steps(
    pipe: Pipeline,
    scaler: GradScaler,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[Any, Any]],
) -> dict[str, list[Any]]:
    """A step of ``pipe`` on each of ``batches`` under ``scaler``, as torch's recipe goes
    (unscale, the global norm, step, update): the losses, scales, skips and norms."""
    out: dict[str, list[Any]] = {"losses": [], "scales": [], "skipped": [], "norms": []}
    for inputs, targets in batches:
        out["losses"].append(pipe.step(inputs, targets))
        scaler.unscale_(optimizer)
        out["norms"].append(float(pipe.clip_grad_norm_(1e9)))
        scaler.step(optimizer)
        out["skipped"].append(scaler.last_step_skipped)
        scaler.update()
        out["scales"].append(scaler.get_scale())
        pipe.zero_grad()
    return out


def parity(
    steps: int, lr: float, scaler_args: dict[str, Any], sharded: bool = False
) -> dict[str, Any]:
    """SGD steps under a scaler whose scale grows; then a loss that is NaN itself.

    ``sharded``: the optimizer of ``pipe.shard_optimizer`` (ZeRO-1), whose
    parameters are this rank's shards and their reduced gradients.
    """
    torch.set_num_threads(1)
    scaler = GradScaler(**scaler_args)
    pipe = _pipeline(False, scaler)
    optimizer = (
        pipe.shard_optimizer(torch.optim.SGD, lr=lr)
        if sharded
        else torch.optim.SGD(pipe.parameters(), lr=lr)
    )
    out = scaled_steps(pipe, scaler, optimizer, (_own(pipe, step) for step in range(steps)))
    losses, scales, norms, skipped = out["losses"], out["scales"], out["norms"], out["skipped"]
    state = {n: t.clone() for n, t in pipe.state_dict().items()}
    x, y = _own(pipe, steps)
    nonfinite = ""
    try:
        pipe.step(x, y * float("nan"))
    except NonFiniteLossError as error:
        nonfinite = type(error).__name__
    pipe.close()
    return {
        "losses": losses,
        "scales": scales,
        "norms": norms,
        "skipped": skipped,
        "state": state,
        "nonfinite": nonfinite,
    }
