"""What the bench needs from one variant: a step it can time, and what the step left.

Every variant (a twobp pipeline, a ``torch.distributed.pipelining`` schedule,
a single-process reference) is wrapped in a :class:`StepRunner` that holds its
own copy of the model and the batch, so that the measuring loop treats them
all alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

SKETCH_PROJECTIONS = 2
"""Random projections of each gradient in its sketch, besides its norm."""


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

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the whole model (``"4.attn.q.weight"``)."""
        ...

    def after_step(self) -> dict[str, float]:
        """Figures of the last step (e.g. ``bubble_ratio``); collective where ``collective``."""
        ...


def gradient_sketch(named: Iterable[tuple[str, nn.Parameter]]) -> dict[str, tuple[float, ...]]:
    """A few numbers per parameter that change whenever its gradient does.

    For each parameter: the 2-norm of its gradient, then its dot products with
    :data:`SKETCH_PROJECTIONS` random vectors drawn from a generator seeded by the
    parameter's name and shape, so that every rank and every variant projects a
    parameter's gradient on the same vectors. A gradient moved between entries or
    between parameters keeps its norm but not its projections. A parameter
    without a gradient counts as a zero gradient.

    Args:
        named: ``(name, parameter)`` pairs, names as in the whole model.

    Returns:
        ``name -> (norm, projection, ...)``, in float64.
    """
    out: dict[str, tuple[float, ...]] = {}
    for name, p in named:
        seed = zlib.crc32(f"{name}:{tuple(p.shape)}".encode())
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(
            SKETCH_PROJECTIONS, p.numel(), generator=generator, dtype=torch.float64
        )
        if p.grad is None:
            grad = torch.zeros(p.numel(), dtype=torch.float64)
        else:
            grad = p.grad.detach().to("cpu", torch.float64).reshape(-1)
        out[name] = (float(grad.norm()), *map(float, directions @ grad))
    return out


def parameter_bytes(runner: StepRunner) -> int:
    """Bytes of this rank's parameters."""
    return sum(p.numel() * p.element_size() for p in runner.parameters())
