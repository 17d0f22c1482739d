"""Where each micro-batch of one stage stands in the 2-stage backward.

Every micro-batch of a step goes through the same phases::

    (unknown) --F--> FORWARD --I--> INPUT --W--> WEIGHT
        \\____________I (forward ran as plain autograd)____^

``B`` (a full backward) is ``I`` then ``W``. Anything else is a mistake of the
caller (a schedule or runtime bug) and raises :class:`TwoStageBackwardError`
before any work is done, with a message that names the micro-batch, the
action and what to do. Micro-batch ids are reused every step, so
:meth:`MicrobatchPhases.end_step` checks that nothing is left half done and
forgets them.

This module imports no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from enum import Enum


class TwoStageBackwardError(RuntimeError):
    """The 2-stage backward was driven in an order it cannot honour.

    Raised for a weight pass (W) before the input pass (I), an I or a W run
    twice, a W for a micro-batch the store does not know, a step finished with
    work pending, or a deferred operation whose backward ran outside
    ``backward_input``.
    """


class Phase(Enum):
    """The last pass a micro-batch finished in the current step."""

    FORWARD = "F done, waiting for I"
    INPUT = "I done, waiting for W"
    WEIGHT = "W done"


class MicrobatchPhases:
    """The phase of every micro-batch of one stage in the current step.

    Args:
        label: names the stage in error messages (e.g. ``"rank 1 stage 3"``).
    """

    def __init__(self, label: str = "") -> None:
        self._label = label
        self._phase: dict[int, Phase] = {}

    def _error(self, text: str) -> TwoStageBackwardError:
        where = f"{self._label}: " if self._label else ""
        return TwoStageBackwardError(where + text)

    def phase(self, mb: int) -> Phase | None:
        """The phase of ``mb``, or None if nothing ran for it in this step."""
        return self._phase.get(mb)

    def known(self) -> tuple[int, ...]:
        """All micro-batches that ran something in this step, sorted."""
        return tuple(sorted(self._phase))

    def pending_weight(self) -> tuple[int, ...]:
        """Micro-batches whose I is done and whose W is not, sorted."""
        return tuple(sorted(m for m, p in self._phase.items() if p is Phase.INPUT))

    def start_forward(self, mb: int) -> None:
        """Record the forward (F) of ``mb``.

        Raises:
            TwoStageBackwardError: if ``mb`` already ran something this step.
        """
        phase = self._phase.get(mb)
        if phase is not None:
            raise self._error(
                f"forward F{mb} of micro-batch {mb} started again, but it is already "
                f"'{phase.value}' in this step; micro-batch ids can be reused only after "
                f"finish_step()"
            )
        self._phase[mb] = Phase.FORWARD

    def cancel_forward(self, mb: int) -> None:
        """Forget a forward of ``mb`` that failed before any backward."""
        if self._phase.get(mb) is Phase.FORWARD:
            del self._phase[mb]

    def check_input(self, mb: int) -> None:
        """Check that the input pass (I) of ``mb`` may run now.

        A micro-batch without a recorded forward is accepted: its forward ran
        as plain autograd, so I computes every gradient at once.

        Raises:
            TwoStageBackwardError: if I or W of ``mb`` already ran this step.
        """
        phase = self._phase.get(mb)
        if phase is Phase.INPUT:
            raise self._error(
                f"backward_input I{mb} ran twice for micro-batch {mb} in this step; each "
                f"micro-batch gets one I, then its W through backward_weight([{mb}, ...])"
            )
        if phase is Phase.WEIGHT:
            raise self._error(
                f"backward_input I{mb} requested for micro-batch {mb}, whose W already ran in "
                f"this step; call finish_step() before reusing micro-batch ids"
            )

    def finish_input(self, mb: int) -> None:
        """Record that the input pass (I) of ``mb`` is done (after :meth:`check_input`)."""
        self._phase[mb] = Phase.INPUT

    def check_weight(self, mbs: Iterable[int]) -> tuple[int, ...]:
        """Check that the weight pass (W) may run for all of ``mbs`` now.

        Nothing is recorded: a W over several micro-batches is refused as a
        whole, before any gradient is touched.

        Args:
            mbs: the micro-batches of the W, in any order.

        Returns:
            ``mbs`` as a tuple, in the given order.

        Raises:
            ValueError: if ``mbs`` is empty or repeats a micro-batch.
            TwoStageBackwardError: if a micro-batch is unknown, has not finished
                its I, or already ran its W.
        """
        group = tuple(mbs)
        if not group:
            raise ValueError("backward_weight needs at least one micro-batch")
        repeats = sorted(m for m, n in Counter(group).items() if n > 1)
        if repeats:
            raise ValueError(f"backward_weight got micro-batch(es) {repeats} more than once")
        for mb in group:
            phase = self._phase.get(mb)
            if phase is None:
                raise self._error(
                    f"backward_weight W{mb} requested for micro-batch {mb}, which has no forward "
                    f"or backward_input in this step (known micro-batches: {list(self.known())})"
                )
            if phase is Phase.FORWARD:
                raise self._error(
                    f"backward_weight W{mb} requested for micro-batch {mb} before its "
                    f"backward_input: W needs what I stashes; run I{mb} first"
                )
            if phase is Phase.WEIGHT:
                raise self._error(
                    f"backward_weight W{mb} ran twice for micro-batch {mb} in this step; "
                    f"its weight gradients are already in .grad"
                )
        return group

    def finish_weight(self, mb: int) -> None:
        """Record that the weight pass (W) of ``mb`` is done (after :meth:`check_weight`)."""
        self._phase[mb] = Phase.WEIGHT

    def end_step(self) -> None:
        """Forget every micro-batch, so that ids can be reused next step.

        The phases are cleared even when this raises, so that the next step
        starts clean.

        Raises:
            TwoStageBackwardError: if a micro-batch had its forward but no I, or
                its I but no W: its gradients are incomplete.
        """
        waiting_input = sorted(m for m, p in self._phase.items() if p is Phase.FORWARD)
        waiting_weight = sorted(m for m, p in self._phase.items() if p is Phase.INPUT)
        self._phase.clear()
        problems = []
        if waiting_input:
            problems.append(f"forward but no backward_input: micro-batches {waiting_input}")
        if waiting_weight:
            problems.append(
                f"backward_input but no backward_weight: micro-batches {waiting_weight}"
            )
        if problems:
            raise self._error(
                "finish_step with unfinished micro-batches ("
                + "; ".join(problems)
                + "); their weight gradients are incomplete. The state was cleared; fix the "
                "schedule so that every F has its I and every I its W"
            )
