"""Functions the tests of a V balanced at its first step run on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime_models import costs_in_proportion
from runtime_workers import needed_batches
from twobp.partition import profiler
from twobp.runtime import Pipeline

WIDTH = 32
BATCH = 16
N_MB = 4


def heavy_ends_blocks() -> list[nn.Module]:
    """Ten float64 blocks: an embedding and a head some 4 times as costly as each of
    the eight layers between them (a decoder's ends, as a V puts them on one rank)."""
    torch.manual_seed(7)

    def end() -> nn.Module:
        return nn.Sequential(
            nn.Linear(WIDTH, 128 * WIDTH), nn.Tanh(), nn.Linear(128 * WIDTH, WIDTH)
        )

    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(8)]
    return [b.double() for b in (end(), *layers, end())]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    x = torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)


def reference(steps: int) -> dict[str, Any]:
    """Losses of ``steps`` SGD steps on one process, and the first step's gradients."""
    model = nn.Sequential(*heavy_ends_blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], {}
    for step in range(steps):
        loss = F.mse_loss(model(batch(step)[0]), batch(step)[1])
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads}


def balanced_at_first_step(schedule: str, steps: int, n_mb: int = N_MB) -> dict[str, Any]:
    """A V built without an example input: what it said before and after its first step,
    the blocks it profiled on rank 0, the partition, losses and first gradients."""
    profiled: list[Any] = []
    measure = profiler.profile_blocks
    # Rank 0's measurement still runs; its times are set to the ends' 4 and the layers'
    # 1 each, so that the partition solved does not turn on the machine's load.
    profiler.profile_blocks = costs_in_proportion(profiled, measure, [4.0] + [1.0] * 8 + [4.0])
    try:
        pipe = Pipeline(heavy_ends_blocks(), F.mse_loss, schedule, n_mb, device="cpu", timeout=60.0)
        before = pipe.partition_by
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses, grads = [], {}
        for step in range(steps):
            # Only rank 0's inputs count for planning: the others may pass what they need
            # (which pipe.needs_inputs already answers).
            inputs, targets = batch(step)
            if step > 0 or dist.get_rank() != 0:
                inputs, targets = needed_batches(pipe, inputs, targets)
            losses.append(pipe.step(inputs, targets))
            if step == 0:
                grads = {
                    n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None
                }
            optimizer.step()
            optimizer.zero_grad()
    finally:
        profiler.profile_blocks = measure
    return {
        "before": before,
        "by": pipe.partition_by,
        "sizes": [len(r) for r in pipe.stage_blocks],
        "costs": profiled,
        "losses": losses,
        "grads": grads,
    }


class Failing(nn.Module):
    """A block that raises while armed."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("block failed on purpose")
        return self.block(x)


def failed_while_balancing() -> dict[str, Any]:
    """A first step whose first block raises while rank 0 profiles it; then a good step."""
    blocks = heavy_ends_blocks()
    trap = Failing(blocks[0])
    blocks[0] = trap
    pipe = Pipeline(blocks, F.mse_loss, "zb-v", N_MB, device="cpu", timeout=60.0)
    inputs, targets = batch(0)
    try:
        pipe.step(inputs if dist.get_rank() == 0 else None, targets)
        failed = ("ok", "")
    except Exception as exc:
        failed = (type(exc).__name__, str(exc))
    trap.armed = False
    loss = pipe.step(inputs if dist.get_rank() == 0 else None, targets)
    grads = {
        n.replace("0.block.", "0.", 1): p.grad.clone()
        for n, p in pipe.named_parameters()
        if p.grad is not None
    }
    return {"failed": failed, "by": pipe.partition_by, "loss": loss, "grads": grads}
