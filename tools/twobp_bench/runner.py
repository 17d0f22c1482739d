"""What the bench needs from one variant: a step it can time, and what the step left.

Every variant (a twobp pipeline, a ``torch.distributed.pipelining`` schedule,
a single-process reference) is wrapped in a :class:`StepRunner` that holds its
own copy of the model and the batch, so that the measuring loop treats them
all alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class StepRunner(Protocol):
    """One variant, ready to run training steps on its fixed batch."""

    collective: bool
    """True if every rank takes part in a step (pipelines); False if each
    rank runs the whole step alone (references)."""

    def step(self) -> None:
        """Run the forward and backward of the whole batch, accumulating gradients."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients (set them to None)."""
        ...

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters."""
        ...

    def after_step(self) -> dict[str, float]:
        """Figures of the last step (e.g. ``bubble_ratio``); collective where ``collective``."""
        ...


def grad_norm(runner: StepRunner, device: torch.device) -> float:
    """The 2-norm of all gradients of the variant's model, over all ranks if it is split.

    Collective for pipeline variants: every rank calls it.
    """
    local = _squares(runner.parameters(), device)
    if runner.collective and dist.is_initialized():
        dist.all_reduce(local)
    return math.sqrt(float(local))


def parameter_bytes(runner: StepRunner) -> int:
    """Bytes of this rank's parameters."""
    return sum(p.numel() * p.element_size() for p in runner.parameters())


def _squares(params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum()
    return total
