"""A model whose boundary layouts follow the inputs' dtype and gradient flag, and its steps.

Each :class:`Carry` block computes in its input's dtype and passes on, next to
its output, the step's input times two: a tensor that needs a gradient only
when the input does. So what crosses each stage boundary changes with the
dtype and the ``requires_grad`` of the step's input, its shapes staying the
same: the case a cache of layouts keyed by shapes alone would get wrong.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.runtime import Pipeline

WIDTH = 4
ROWS = 4
N_MB = 2
# (dtype, requires_grad) of each step's input: one of the two changes at a time, and
# steps come back to signatures seen before.
STEPS = [
    (torch.float64, False),
    (torch.float64, True),
    (torch.float64, False),
    (torch.float32, False),
    (torch.float64, False),
    (torch.float32, False),
    (torch.float32, True),
    (torch.float64, True),
]
CONFIGS = [
    ("1f1b", True, None),
    ("1f1b", False, None),
    ("zb-h1", True, "all"),
]
"""(schedule, two_bp, recompute) of each pipeline."""


class Carry(nn.Module):
    """``tanh(linear(h)) + c`` in the dtype of ``h``, and ``2 c``; the first takes ``h = c = x``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, batch: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, carried = batch if isinstance(batch, tuple) else (batch, batch)
        weight, bias = (t.to(h.dtype) for t in (self.linear.weight, self.linear.bias))
        return torch.tanh(F.linear(h, weight, bias)) + carried, 2 * carried


def build_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Carry() for _ in range(4)]


def loss(outputs: tuple[Tensor, Tensor], targets: Tensor) -> Tensor:
    h, carried = outputs
    return ((h + carried).double() - targets).pow(2).mean()


def make_batch(step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s input, in its dtype and gradient flag, and its float64 targets."""
    dtype, requires_grad = STEPS[step]
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    targets = torch.randn(ROWS, WIDTH, generator=gen, dtype=torch.float64)
    return x.to(dtype).requires_grad_(requires_grad), targets


def _grads(parameters: Any) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in parameters if p.grad is not None}


def run_steps(schedule: str, two_bp: bool, recompute: str | None) -> list[dict[str, Any]]:
    """Every step of :data:`STEPS`: loss, input and parameter gradients, layout messages."""
    results = []
    with Pipeline(
        build_blocks(), loss, schedule, N_MB, two_bp=two_bp, recompute=recompute, device="cpu",
        timeout=30.0,
    ) as pipe:  # fmt: skip
        for step in range(len(STEPS)):
            x, targets = make_batch(step)
            results.append(
                {
                    "loss": pipe.step(x, targets),
                    "input grad": x.grad,
                    "grads": _grads(pipe.named_parameters()),
                    "messages": pipe.step_times.layout_messages,
                }
            )
            pipe.zero_grad()
    return results


def run_configs() -> dict[str, Any]:
    """:func:`run_steps` of every pipeline of :data:`CONFIGS`, keyed by its text."""
    torch.set_num_threads(1)
    return {repr(c): run_steps(*c) for c in CONFIGS}


def reference() -> list[dict[str, Any]]:
    """What plain PyTorch gives for each step, micro-batch by micro-batch."""
    model = nn.Sequential(*build_blocks())
    results = []
    for step in range(len(STEPS)):
        x, targets = make_batch(step)
        total = 0.0
        for part, part_targets in zip(x.chunk(N_MB), targets.chunk(N_MB), strict=True):
            part_loss = loss(model(part), part_targets) / N_MB
            part_loss.backward()
            total += float(part_loss.detach())
        results.append(
            {"loss": total, "input grad": x.grad, "grads": _grads(model.named_parameters())}
        )
        model.zero_grad()
    return results
