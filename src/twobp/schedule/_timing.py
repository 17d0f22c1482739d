"""Predicted times and the 2BP weight placement, private to the schedule layer.

The ``paper`` and ``fill`` policies of :mod:`twobp.schedule.two_bp` place
each ``W`` in a slot where its rank would otherwise wait. They predict times
with this module rather than :mod:`twobp.sim`, so that the schedule layer
depends on nothing above it; any cost model with a ``duration(action)``
method (such as :class:`twobp.sim.CostModel`) can be passed in.

The placement is a walk (:mod:`twobp.schedule.walk`) of the ``F`` and ``I``
with a fill that runs a stored ``W`` where it does not delay the rank.
This module imports no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from twobp.schedule.action import Action, Kind
from twobp.schedule.kinds import kind_spec
from twobp.schedule.schedule import Schedule
from twobp.schedule.walk import Run, Walker, walk

_EPS = 1e-9


@runtime_checkable
class SupportsDuration(Protocol):
    """A cost model: the compute time of an action (``twobp.sim.CostModel`` is one)."""

    def duration(self, action: Action) -> float: ...


Costs: TypeAlias = SupportsDuration | Mapping[str, float | Sequence[float]] | None
"""Costs accepted by the placement policies: a cost model with
``duration(action)``, a mapping from kind letter (``"F"``, ``"I"``, ``"W"``,
optionally ``"B"``, default ``I + W``) to a time or a list of times per stage,
or ``None`` for unit times (``F = I = W = 1``, ``B = 2``)."""


@dataclass(frozen=True)
class Timing:
    """Compute time of an action and transfer time across a stage boundary."""

    duration: Callable[[Action], float]
    transfer: Callable[[int], float]


def make_timing(costs: Costs) -> Timing:
    """Turn any accepted form of ``costs`` into a :class:`Timing`.

    Raises:
        ValueError: on a mapping without ``F``, ``I`` and ``W`` or with a
            negative time.
    """
    if costs is None:
        costs = {"F": 1.0, "I": 1.0, "W": 1.0}
    if isinstance(costs, SupportsDuration):
        model = costs
        transfer = getattr(model, "transfer_time", None)
        return Timing(model.duration, transfer if callable(transfer) else (lambda _b: 0.0))
    table = dict(costs)
    missing = [k for k in ("F", "I", "W") if k not in table]
    if missing:
        raise ValueError(
            f"costs need times for F, I and W (B defaults to I + W); missing {missing}"
        )

    def per_stage(kind: str, stage: int) -> float:
        value = table[kind]
        if not isinstance(value, (int, float)) and stage >= len(value):
            raise ValueError(
                f"costs[{kind!r}] has {len(value)} entries, but the schedule has a stage {stage}: "
                "give one time per stage"
            )
        t = float(value if isinstance(value, (int, float)) else value[stage])
        if t < 0:
            raise ValueError(f"cost of {kind} on stage {stage} must be >= 0, got {t}")
        return t

    def duration(a: Action) -> float:
        kind = a.kind.value
        if kind_spec(a.kind).cost is None:
            return 0.0
        if kind == "B" and "B" not in table:
            return per_stage("I", a.stage) + per_stage("W", a.stage)
        return per_stage(kind, a.stage) * len(a.microbatches)

    return Timing(duration, lambda _b: 0.0)


def place_weights(
    schedule: Schedule,
    timing: Timing,
    *,
    cooldown_only: bool,
    memory_limit: int | None,
) -> dict[int, list[Action]]:
    """Insert one ``W`` per ``I`` where its rank would otherwise wait.

    The ranks' ``F`` and ``I`` keep their order. Walking the predicted time
    forward, a rank that has stored weight passes runs the oldest one when
    the wait for its next ``F``/``I`` is at least as long as that ``W`` (so
    the ``W`` never delays it), or, with ``memory_limit``, when its next
    ``F`` would otherwise hold more than ``memory_limit`` micro-batches
    (``F`` done and ``W`` not done). What is left is run at the end as one
    concatenated ``W`` per stage, from the last stage to the first.

    Args:
        schedule: a schedule of ``F`` and ``I`` only.
        timing: the cost model.
        cooldown_only: place a ``W`` only once its rank has no ``F`` left.
        memory_limit: the most micro-batches a rank may hold, or ``None``.

    Returns:
        The new action list of every rank.

    Raises:
        DeadlockError: if the schedule cannot finish.
    """
    slots = _WeightSlots(schedule, timing.duration, cooldown_only, memory_limit)
    walked = walk(schedule, timing.duration, transfer=timing.transfer, fill=slots.offer)
    out: dict[int, list[Action]] = {}
    for rank, runs in walked.runs.items():
        out[rank] = [run.action for run in runs]
        by_stage: dict[int, list[int]] = {}
        for w in slots.stored(rank, runs):
            by_stage.setdefault(w.stage, []).extend(w.microbatches)
        for stage in sorted(by_stage, reverse=True):
            out[rank].append(Action.make(stage, Kind.BACKWARD_WEIGHT, by_stage[stage]))
    return out


class _WeightSlots:
    """The ``W`` each rank has stored (its ``I`` ran), and when one may run.

    The walker asks :meth:`offer` before every start; the counts follow what
    each rank has run so far.
    """

    def __init__(
        self,
        schedule: Schedule,
        duration: Callable[[Action], float],
        cooldown_only: bool,
        memory_limit: int | None,
    ) -> None:
        self._duration = duration
        self._cooldown_only = cooldown_only
        self._memory_limit = memory_limit
        ranks = list(schedule.actions)
        self._forwards_left = {
            r: sum(a.kind is Kind.FORWARD for a in schedule.actions[r]) for r in ranks
        }
        self._held = dict.fromkeys(ranks, 0)
        self._stored: dict[int, deque[Action]] = {r: deque() for r in ranks}
        self._seen = dict.fromkeys(ranks, 0)

    def offer(self, walker: Walker, rank: int) -> Action | None:
        """The oldest stored ``W`` of ``rank`` if it may run now, else None."""
        stored = self.stored(rank, walker.runs(rank))
        if not stored or (self._cooldown_only and self._forwards_left[rank]):
            return None
        following = walker.next_action(rank)
        forced = (
            self._memory_limit is not None
            and following is not None
            and following.kind is Kind.FORWARD
            and self._held[rank] >= self._memory_limit
        )
        fits = (
            walker.free_at(rank) + self._duration(stored[0]) <= walker.earliest_start(rank) + _EPS
        )
        return stored[0] if forced or fits else None

    def stored(self, rank: int, runs: Sequence[Run]) -> deque[Action]:
        """The ``W`` of ``rank`` not run yet, once ``runs`` (what it ran) are counted."""
        for run in runs[self._seen[rank] :]:
            kind = run.action.kind
            if kind is Kind.FORWARD:
                self._held[rank] += 1
                self._forwards_left[rank] -= 1
            elif kind is Kind.BACKWARD_INPUT:
                self._stored[rank].append(
                    Action(run.action.stage, Kind.BACKWARD_WEIGHT, run.action.microbatches)
                )
            elif kind is Kind.BACKWARD_WEIGHT:
                self._stored[rank].popleft()
                self._held[rank] -= 1
        self._seen[rank] = len(runs)
        return self._stored[rank]
