"""The backward passes of one stage: full (B), input-only (I) and weight-only (W).

A stage drives its backward through the :class:`StageGradients` interface,
whose methods are those of the 2BP engine's per-stage store
(:func:`twobp.engine.defer_weight_grads`). :func:`stage_gradients` picks the
implementation: plain autograd for stages that only run ``B``, the engine's
store for stages that run ``I`` and ``W``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

Grads = tuple[Tensor | None, ...]
"""Gradients with respect to the stage inputs (None where an input is unused)."""

Rebuild = Callable[[int], tuple[Sequence[Tensor], Sequence[Tensor | None]]]
"""Re-runs the forward of a micro-batch: its outputs and their gradients."""


class StageGradients(Protocol):
    """What a stage needs from its backward machinery, per micro-batch ``mb``."""

    def forward(self, mb: int) -> contextlib.AbstractContextManager[None]:
        """Context in which the forward of ``mb`` runs."""
        ...

    def backward_full(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
    ) -> Grads:
        """B: input and weight gradients of ``mb``; returns the input gradients."""
        ...

    def backward_input(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
        keep_stash: bool = True,
    ) -> Grads:
        """I: input gradients of ``mb``; weight gradients wait for :meth:`backward_weight`.

        ``keep_stash=False`` keeps nothing for W: its ``rebuild`` recomputes it."""
        ...

    def backward_weight(
        self,
        mbs: Sequence[int],
        weight_group_size: int | None = None,
        rebuild: Rebuild | None = None,
    ) -> None:
        """W: accumulate the weight gradients of ``mbs`` into ``.grad``."""
        ...

    def backward_weight_in_parts(
        self, mbs: Sequence[int], weight_group_size: int | None = None
    ) -> Iterator[None]:
        """W of ``mbs`` one part (a layer's weight gradients) per ``next()``."""
        ...

    def stashed_tensors(self, mb: int) -> list[Tensor]:
        """The tensors kept for the W of ``mb`` now."""
        ...

    def pending_weight(self) -> tuple[int, ...]:
        """Micro-batches whose I is done and whose W is not, sorted."""
        ...

    def finish_step(self) -> None:
        """Check that no work is pending and forget this step's micro-batches."""
        ...

    def stashed_bytes(self) -> dict[int, int]:
        """Bytes kept for W, per micro-batch of this step."""
        ...

    def restore(self) -> None:
        """Let go of the module: drop pending work; another stage may then be built on it."""
        ...

    def release(self) -> None:
        """Let another stage defer the module until :meth:`claim` (between steps)."""
        ...

    def claim(self) -> None:
        """Take the module back after :meth:`release`."""
        ...


class AutogradGradients:
    """Plain autograd: ``B`` is one ``torch.autograd.backward`` call.

    ``I`` and ``W`` are supported without the engine by keeping the graph
    after ``I`` and running a second backward restricted to the parameters at
    ``W``: correct, but the second pass repeats the work of the first. The
    pipeline uses the engine's store for stages that run ``I`` and ``W``; this
    path serves as an independent reference.

    Args:
        module: the stage's module (its parameters receive the gradients).
    """

    def __init__(self, module: nn.Module) -> None:
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._pending: dict[int, tuple[Sequence[Tensor], Sequence[Tensor]]] = {}

    @contextlib.contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        yield

    def backward_full(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
    ) -> Grads:
        if outputs:
            torch.autograd.backward(list(outputs), list(grad_outputs))
        # A first stage may run on views of an input that requires grad: their gradient
        # reaches that input through autograd, and a view keeps none to return.
        return tuple(x.grad if x.is_leaf else None for x in inputs)

    def backward_input(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor],
        inputs: Sequence[Tensor],
        keep_stash: bool = True,
    ) -> Grads:
        # The graph is the stash here: it is kept whatever keep_stash says.
        self._pending[mb] = (outputs, grad_outputs)
        if not inputs or not outputs:
            return tuple(None for _ in inputs)
        return torch.autograd.grad(
            list(outputs), list(inputs), list(grad_outputs), retain_graph=True, allow_unused=True
        )

    def backward_weight(
        self,
        mbs: Sequence[int],
        weight_group_size: int | None = None,
        rebuild: Rebuild | None = None,
    ) -> None:
        for mb in mbs:
            if mb not in self._pending:
                raise RuntimeError(f"W of micro-batch {mb} before its I")
            outputs, grad_outputs = self._pending.pop(mb)
            if self._params and outputs:
                torch.autograd.backward(list(outputs), list(grad_outputs), inputs=self._params)

    def backward_weight_in_parts(
        self, mbs: Sequence[int], weight_group_size: int | None = None
    ) -> Iterator[None]:
        # One part: a restricted backward cannot stop between layers.
        self.backward_weight(mbs, weight_group_size)
        yield

    def stashed_bytes(self) -> dict[int, int]:
        # The retained graphs are not counted: this fallback has no stash of its own.
        return {}

    def stashed_tensors(self, mb: int) -> list[Tensor]:
        return []

    def pending_weight(self) -> tuple[int, ...]:
        return tuple(sorted(self._pending))

    def restore(self) -> None:
        self._pending.clear()

    def release(self) -> None:
        pass  # plain autograd holds nothing of the module

    def claim(self) -> None:
        pass

    def finish_step(self) -> None:
        if self._pending:
            raise RuntimeError(
                f"the step ended with weight gradients pending for micro-batches "
                f"{sorted(self._pending)}: the schedule lacks their W"
            )


def stage_gradients(module: nn.Module, split: bool, label: str = "") -> StageGradients:
    """The backward machinery of one stage.

    Args:
        module: the stage's module.
        split: True if the stage runs ``I`` and ``W`` (2BP), False for ``B`` only.
        label: names the stage in the engine's errors (``"rank 1 stage 3"``).

    Returns:
        Plain autograd for ``B``-only stages; the 2BP engine's store for split stages.
    """
    if not split:
        return AutogradGradients(module)
    from twobp.engine import defer_weight_grads

    store: StageGradients = defer_weight_grads(module, label=label)
    return store
