"""The ``dynamic`` 2BP policy at run time: stored ``W`` run in the waits the step meets.

A schedule split by the ``dynamic`` policy (:func:`twobp.schedule.apply_two_bp`)
lists a ``W`` only where ``memory_limit`` forces one and the rest at the end.
While a rank would block on a receive whose data has not arrived, its
dispatcher (:class:`twobp.runtime.execution.step_run.StepRun`) asks
:class:`WaitFiller` for one part of a stored ``W`` at a time: one layer's
concatenated weight gradients (the engine's
:meth:`~twobp.engine.WeightGradStore.backward_weight_in_parts`), so the rank comes
back to the receive within one layer's ``W`` of the data arriving. A ``W``
started in a wait covers the stored micro-batches of the listed ``W`` that holds
the oldest one, concatenated as that ``W`` would be. When the list
reaches a ``W``, it finishes the part-run one that overlaps it and runs only
the micro-batches no wait covered; a ``W`` whose micro-batches all ran in
waits runs nothing. Every ``W`` thus runs exactly once, whatever the timing.

:class:`EarlyReductions` lets a stage's gradient reduction ``R`` start as soon
as the waits have run its last ``W``, in the order the list gives the ``R``
(the same on every copy, so collectives pair up whatever each copy's timing).

Stages whose ``W`` rebuilds dropped stashes (``recompute="derivatives"``, an
``IR``) are left to the list.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from twobp.runtime.execution.stage import Stage
from twobp.schedule.action import Action, Kind

_DONE = object()
"""What ``next`` gives once a ``W``'s parts have all run."""


@dataclass
class _Running:
    action: Action
    parts: Iterator[None]


class WaitFiller:
    """The ``W`` a rank has stored (its ``I`` ran) and can run in a wait, one part at a time.

    Args:
        stages: this rank's stages, by index.
        weight_group_size: the engine's concatenation cap of each ``W``.
        eligible: the stages whose stored ``W`` may run in waits.
        actions: the rank's actions in order: a ``W`` started in a wait concatenates
            the stored micro-batches of the listed ``W`` that holds the oldest one (the
            schedule's grouping: one ``W`` over all of a stage's micro-batches at the end
            of a ``dynamic`` list, single ones where a ``zb-*`` lists them so).
    """

    def __init__(
        self,
        stages: Mapping[int, Stage],
        weight_group_size: int | None,
        eligible: frozenset[int],
        actions: Sequence[Action] = (),
    ) -> None:
        self._stages = stages
        self._group = weight_group_size
        self._eligible = eligible
        self._listed = {
            (a.stage, mb): a.microbatches
            for a in actions
            if a.kind is Kind.BACKWARD_WEIGHT
            for mb in a.microbatches
        }
        self._stored: list[tuple[int, int]] = []
        self._running: _Running | None = None
        self.done: set[tuple[int, int]] = set()
        """``(stage, micro-batch)`` of every ``W`` run in a wait so far (whole, not in part)."""

    def stored(self, action: Action) -> None:
        """Record the ``I`` ``action``: its micro-batches' ``W`` may now run in a wait."""
        if action.kind is Kind.BACKWARD_INPUT and action.stage in self._eligible:
            self._stored.extend((action.stage, mb) for mb in action.microbatches)

    @property
    def has_work(self) -> bool:
        """Whether a wait has a ``W`` part to run."""
        return self._running is not None or bool(self._stored)

    def run_part(self) -> tuple[Action, bool]:
        """Run the next part of the ``W`` under way (or start one): the ``W`` action it
        belongs to, and whether that ``W`` is now done."""
        if self._running is None:
            oldest = self._stored[0]
            stage, together = oldest[0], self._listed.get(oldest)
            mine = [(s, mb) for s, mb in self._stored if s == stage]
            taken = [k for k in mine if together is None or k[1] in together]
            mbs = tuple(mb for _, mb in taken)
            self._stored = [k for k in self._stored if k not in taken]
            parts = self._stages[stage].weight_in_parts(mbs, self._group)
            self._running = _Running(Action.make(stage, Kind.BACKWARD_WEIGHT, mbs), parts)
        running = self._running
        finished = next(running.parts, _DONE) is _DONE
        if finished:
            self._running = None
            self.done.update((running.action.stage, mb) for mb in running.action.microbatches)
        return running.action, finished

    def take(self, action: Action) -> tuple[tuple[int, ...], Action | None]:
        """The micro-batches the listed ``W`` ``action`` still has to run, and the ``W``
        under way that shared one, if any, which this finished first. Stored ones are
        taken off the queue."""
        mine = {(action.stage, mb) for mb in action.microbatches}
        running, finished = self._running, None
        if running is not None and any(
            (running.action.stage, mb) in mine for mb in running.action.microbatches
        ):
            for _ in running.parts:
                pass
            self._running, finished = None, running.action
            self.done.update((running.action.stage, mb) for mb in running.action.microbatches)
        self._stored = [key for key in self._stored if key not in mine]
        left = tuple(mb for mb in action.microbatches if (action.stage, mb) not in self.done)
        return left, finished

    def unfinished(self) -> Action | None:
        """The ``W`` left part-run (none once the list has run every ``W``)."""
        return self._running.action if self._running is not None else None


@dataclass(frozen=True)
class _Reduction:
    index: int
    stage: int
    inputs_done_at: int
    """The list position of the stage's last ``F``/``I``/``B`` before the ``R``."""
    weights: tuple[tuple[int, tuple[int, ...]], ...]
    """The list position and micro-batches of each of the stage's ``W`` before the ``R``."""

    def may_start(self, position: int, done: set[tuple[int, int]]) -> bool:
        """Whether everything it reduces has run before list position ``position``."""
        if self.inputs_done_at >= position:
            return False
        return all(
            at < position or all((self.stage, mb) in done for mb in mbs) for at, mbs in self.weights
        )


class EarlyReductions:
    """Which listed ``R`` may start before their place, now that waits ran their ``W``.

    An ``R`` may start once every compute action of its stage listed before it
    has run (a ``W`` counts as run once a wait ran all its micro-batches), and
    every ``R`` listed before it has started.

    Args:
        actions: the rank's lowered actions in order.
    """

    def __init__(self, actions: Sequence[Action]) -> None:
        self._pending: list[_Reduction] = []
        for index, action in enumerate(actions):
            if action.kind is not Kind.REDUCE:
                continue
            before = [
                (i, a)
                for i, a in enumerate(actions[:index])
                if a.kind.is_compute and a.kind is not Kind.REDUCE and a.stage == action.stage
            ]
            weights = tuple(
                (i, a.microbatches)
                for i, a in before
                if a.kind in (Kind.BACKWARD_WEIGHT, Kind.BACKWARD_WEIGHT_REBUILD)
            )
            inputs = [
                i
                for i, a in before
                if a.kind not in (Kind.BACKWARD_WEIGHT, Kind.BACKWARD_WEIGHT_REBUILD)
            ]
            self._pending.append(_Reduction(index, action.stage, max(inputs, default=-1), weights))
        self.started: set[int] = set()
        """List positions of the ``R`` started ahead of their place."""

    def ready(self, position: int, done: set[tuple[int, int]]) -> list[int]:
        """The stages whose ``R`` may start now, at list position ``position`` (the
        action being run; those before it have run), in order; each then counts as
        started."""
        stages = []
        while self._pending:
            r = self._pending[0]
            if r.index <= position:
                self._pending.pop(0)  # its turn in the list came: it starts there
                continue
            if not r.may_start(position, done):
                break
            self._pending.pop(0)
            self.started.add(r.index)
            stages.append(r.stage)
        return stages
