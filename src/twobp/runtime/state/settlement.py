"""How a training step's gradients are settled: kept, divided, or dropped.

A step computes and reduces only its own gradients (the earlier steps' are set
aside, :mod:`twobp.runtime.state.accumulation`). At its end:

* a loss that returned ``(sum, count)`` divides the step's gradients by the
  count over the whole batch (the parameters' ``grad``, and under a sharded
  optimizer the step's reduced shards, which hold the replicated parameters'
  gradients: their ``grad`` was dropped at ``R``);
* a finite loss keeps them: the earlier gradients are added back and the
  shards committed;
* a loss that is not finite drops them on every rank alike (every rank learnt
  the loss from the last stage): the earlier gradients are restored, the
  shards discarded, and the step is skipped or raises, by ``nonfinite``;
* a step that failed drops them the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from twobp.runtime.errors import nonfinite_error
from twobp.runtime.execution.step_end import StepEnd
from twobp.runtime.state.accumulation import EarlierGradients
from twobp.runtime.state.sharded_optimizer import ShardedParameters


class Settlement:
    """The gradients of this rank's steps, settled one step at a time.

    Args:
        parameters: this rank's parameters (called each step: a sharded
            optimizer may replace their storage).
        sharded: this rank's optimizer shards, if a sharded optimizer was made.
        rank: this rank (for messages).
        nonfinite: ``"raise"`` or ``"skip"`` a step whose loss is not finite.
        dp_size: copies of the pipeline (the count of a ``(sum, count)`` loss is
            summed over them, and the reduction averages over them).
    """

    def __init__(
        self,
        parameters: Callable[[], Iterable[nn.Parameter]],
        sharded: Callable[[], ShardedParameters | None],
        rank: int,
        nonfinite: str,
        dp_size: int,
    ) -> None:
        self._parameters = parameters
        self._sharded = sharded
        self._rank = rank
        self._nonfinite = nonfinite
        self._dp_size = dp_size
        self.earlier = EarlierGradients()
        """The earlier steps' gradients, aside while a step runs."""
        self.skipped_steps: list[int] = []
        """Indices of the steps skipped for a non-finite loss (``nonfinite="skip"``)."""
        self.last_step_skipped = False
        """True if the last step's loss was not finite and its gradients were dropped."""

    def begin(self) -> None:
        """A step starts: set the earlier gradients aside."""
        self.earlier.set_aside(self._parameters())

    def failed(self) -> None:
        """The step failed: drop its gradients, restore the earlier ones."""
        self.earlier.put_back()
        sharded = self._sharded()
        if sharded is not None:
            sharded.discard()

    def finish(self, end: StepEnd, step: int) -> float:
        """The step ended with ``end``: keep or drop its gradients.

        Returns:
            The step's mean loss.

        Raises:
            NonFiniteLossError: if the loss is not finite and ``nonfinite="raise"``.
        """
        loss = end.loss
        assert loss is not None
        finite = math.isfinite(loss)
        if end.count is not None and finite:
            self._divide(end.count / self._dp_size)
        self.last_step_skipped = not finite
        sharded = self._sharded()
        if finite:
            self.earlier.add_back()
            if sharded is not None:
                sharded.commit()
            return loss
        self.failed()
        if self._nonfinite == "raise":
            raise nonfinite_error(self._rank, step, loss, end.first_bad, end.bad_rank)
        self.skipped_steps.append(step)
        return loss

    @torch.no_grad()
    def _divide(self, divisor: float) -> None:
        """Divide the step's own gradients, wherever they live, by ``divisor``."""
        for p in self._parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
        sharded = self._sharded()
        if sharded is not None:
            sharded.divide_pending(divisor)
