"""Gradients accumulated over steps: earlier steps' ``.grad`` set aside while a step runs.

A PyTorch user accumulates gradients by calling ``backward`` (here
:meth:`~twobp.runtime.Pipeline.step`) several times before
``optimizer.step()``. A pipeline cannot simply add each step into ``.grad`` in
place: the ``R`` action sums ``.grad`` of a replicated or tied parameter over
every rank that holds it, and each of them holds the earlier steps' (already
reduced) gradient, which would then be counted once per holder. And a step
that fails, or is skipped for a non-finite loss, must leave the earlier steps'
gradients as they were.

So a training step starts with :meth:`EarlierGradients.set_aside`: every
parameter's ``.grad`` is moved aside (not copied) and reset to None; the step
computes and reduces its own gradients only; :meth:`EarlierGradients.add_back`
adds the earlier ones back when the step succeeded, and
:meth:`EarlierGradients.put_back` drops the step's gradients and restores the
earlier ones when it did not. The cost is memory while accumulating: during a
step the earlier gradients and the step's own are held at once (nothing extra
after ``zero_grad(set_to_none=True)``, which leaves no gradient to set aside).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn


class EarlierGradients:
    """The ``.grad`` of this rank's parameters before the step in flight."""

    def __init__(self) -> None:
        self._params: list[nn.Parameter] = []
        self._held: dict[int, Tensor] = {}
        self.last_nbytes = 0
        """Bytes set aside in the last step (0 when no earlier step left gradients)."""

    def set_aside(self, parameters: Iterable[nn.Parameter]) -> None:
        """Move every parameter's ``.grad`` aside and reset it to None.

        Raises:
            RuntimeError: if gradients are already set aside (a step is in flight).
        """
        if self._params:
            raise RuntimeError("gradients of an earlier step are already set aside")
        seen: set[int] = set()
        for p in parameters:
            if id(p) in seen:
                continue
            seen.add(id(p))
            self._params.append(p)
            if p.grad is not None:
                self._held[id(p)] = p.grad
                p.grad = None
        self.last_nbytes = sum(g.numel() * g.element_size() for g in self._held.values())

    @torch.no_grad()
    def add_back(self) -> None:
        """The step succeeded: ``.grad`` becomes the earlier gradients plus the step's."""
        for p in self._params:
            earlier = self._held.get(id(p))
            if earlier is None:
                continue
            if p.grad is None:
                p.grad = earlier
            else:
                p.grad = earlier.add_(p.grad)
        self._clear()

    def put_back(self) -> None:
        """The step failed or was skipped: drop its gradients, restore the earlier ones."""
        for p in self._params:
            p.grad = self._held.get(id(p))
        self._clear()

    def _clear(self) -> None:
        self._params = []
        self._held = {}
