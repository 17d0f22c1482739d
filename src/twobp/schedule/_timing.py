"""Predicted times and the 2BP weight placement, private to the schedule layer.

The ``paper`` and ``fill`` policies of :mod:`twobp.schedule.two_bp` place
each ``W`` in a slot where its rank would otherwise wait. They predict times
with this module rather than :mod:`twobp.sim`, so that the schedule layer
depends on nothing above it; any cost model with a ``duration(action)``
method (such as :class:`twobp.sim.CostModel`) can be passed in. The
simulator times a rank with the same rule (:func:`rank_time`): an action
whose result goes to another rank also holds its rank for the cost model's
``send_overhead``.

The placement is a walk (:mod:`twobp.schedule.walk`) of the ``F`` and ``I``
with a fill that runs a stored ``W`` where it does not delay the rank.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from twobp.schedule.action import Action, Kind
from twobp.schedule.kinds import STORED_DERIVATIVES, kind_spec
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import produced_transfer
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


def make_timing(costs: Costs, schedule: Schedule) -> Timing:
    """Turn any accepted form of ``costs`` into a :class:`Timing` of ``schedule``'s ranks.

    A cost model with ``duration(action)`` may also have ``transfer_time(boundary)``
    (the delay of a transfer between ranks) and ``send_overhead`` (the time
    a send holds its sender, see :func:`rank_time`); both are 0 without.

    Args:
        costs: the costs, in any form of :data:`Costs`.
        schedule: the schedule to time (its placement says which results
            cross ranks).

    Returns:
        The time each action holds its rank, and the transfer delays.

    Raises:
        ValueError: on a mapping without ``F``, ``I`` and ``W`` or with a
            negative time.
    """
    if costs is None:
        costs = {"F": 1.0, "I": 1.0, "W": 1.0}
    if isinstance(costs, SupportsDuration):
        model = costs
        transfer = getattr(model, "transfer_time", None)
        overhead = float(getattr(model, "send_overhead", 0.0))
        return Timing(
            rank_time(schedule, model.duration, overhead),
            transfer if callable(transfer) else (lambda _b: 0.0),
        )
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
        if kind == "IR":
            return per_stage("I", a.stage)
        if kind == "WR":  # W after the F and I that rebuild its stash
            once = per_stage("F", a.stage) + per_stage("I", a.stage) + per_stage("W", a.stage)
            return once * len(a.microbatches)
        return per_stage(kind, a.stage) * len(a.microbatches)

    return Timing(duration, lambda _b: 0.0)


def rank_time(
    schedule: Schedule, duration: Callable[[Action], float], send_overhead: float
) -> Callable[[Action], float]:
    """The time an action holds its rank: its compute, and the sending of its result.

    Args:
        schedule: the schedule (its placement says which results cross ranks).
        duration: the compute time of an action.
        send_overhead: the time a transfer to another rank holds its sender.

    Returns:
        ``duration(action)``, plus ``send_overhead`` where the action's result
        goes to a stage on another rank (``duration`` itself when it is 0).
    """
    if send_overhead == 0:
        return duration
    graph = schedule.graph

    def held(action: Action) -> float:
        sent = produced_transfer(action, graph)
        crosses = sent is not None and not sent.is_local
        return duration(action) + (send_overhead if crosses else 0.0)

    return held


def place_weights(
    schedule: Schedule,
    timing: Timing,
    *,
    cooldown_only: bool,
    memory_limit: int | None,
    microbatches_per_w: int | None = None,
    forced_only: bool = False,
) -> dict[int, list[Action]]:
    """Insert the ``W`` of every ``I`` where its rank would otherwise wait.

    The ranks' ``F`` and ``I`` keep their order. Walking the predicted time
    forward, a rank that has stored weight passes runs the oldest one when
    the wait for its next ``F``/``I`` is at least as long as that ``W`` (so
    the ``W`` never delays it), or, with ``memory_limit``, when its next
    ``F`` would otherwise hold more than ``memory_limit`` micro-batches
    (``F`` done and ``W`` not done). If the cost model makes a ``W`` over
    ``k`` micro-batches cheaper than ``k`` single ones, the oldest is grouped
    with the later stored ``W`` of its stage, as many as fit in the wait.
    What is left is run at the end as one concatenated ``W`` per stage (in
    groups of at most ``microbatches_per_w``), from the last stage to the first.

    Args:
        schedule: a schedule of ``F`` and ``I`` only.
        timing: the cost model.
        cooldown_only: place a ``W`` only once its rank has no ``F`` left.
        memory_limit: the most micro-batches a rank may hold, or ``None``.
        microbatches_per_w: the most micro-batches one ``W`` covers, or ``None``.
        forced_only: place a ``W`` only where ``memory_limit`` forces it, none in
            waits (the ``dynamic`` policy, whose runtime fills the waits it meets).

    Returns:
        The new action list of every rank.

    Raises:
        DeadlockError: if the schedule cannot finish.
    """
    slots = _WeightSlots(
        schedule, timing.duration, cooldown_only, memory_limit, microbatches_per_w, forced_only
    )
    walked = walk(schedule, timing.duration, transfer=timing.transfer, fill=slots.offer)
    out: dict[int, list[Action]] = {}
    for rank, runs in walked.runs.items():
        out[rank] = [run.action for run in runs]
        by_stage: dict[int, list[int]] = {}
        for w in slots.stored(rank, runs):
            by_stage.setdefault(w.stage, []).extend(w.microbatches)
        for stage in sorted(by_stage, reverse=True):
            left = by_stage[stage]
            step = microbatches_per_w or len(left)
            for first in range(0, len(left), step):
                out[rank].append(
                    Action.make(stage, Kind.BACKWARD_WEIGHT, left[first : first + step])
                )
    return out


class _WeightSlots:
    """The ``W`` each rank has stored (its ``I`` ran), and when one may run.

    The walker asks :meth:`offer` before every start; the counts follow what
    each rank has run so far. Where the cost model makes a ``W`` over several
    micro-batches cheaper than as many single ones (a concatenated ``W``), a
    gap gets the largest group of one stage's stored ``W`` that fits in it.
    """

    def __init__(
        self,
        schedule: Schedule,
        duration: Callable[[Action], float],
        cooldown_only: bool,
        memory_limit: int | None,
        microbatches_per_w: int | None,
        forced_only: bool = False,
    ) -> None:
        self._duration = duration
        self._forced_only = forced_only
        self._cooldown_only = cooldown_only
        self._memory_limit = memory_limit
        self._microbatches_per_w = microbatches_per_w
        ranks = list(schedule.actions)
        self._forwards_left = {
            r: sum(a.kind is Kind.FORWARD for a in schedule.actions[r]) for r in ranks
        }
        self._held = dict.fromkeys(ranks, 0)
        self._stored: dict[int, list[Action]] = {r: [] for r in ranks}
        self._seen = dict.fromkeys(ranks, 0)

    def offer(self, walker: Walker, rank: int) -> Action | None:
        """The stored ``W`` (oldest first, grouped if cheaper) ``rank`` may run now, or None."""
        stored = self.stored(rank, walker.runs(rank))
        if not stored or (self._cooldown_only and self._forwards_left[rank]):
            return None
        following = walker.next_action(rank)
        forced = (
            self._memory_limit is not None
            and following is not None
            and following.held_change() > 0
            and self._held[rank] >= self._memory_limit
        )
        if self._forced_only:
            return stored[0] if forced else None
        group = self._group_in(stored, walker.earliest_start(rank) - walker.free_at(rank))
        return stored[0] if group is None and forced else group

    def _group_in(self, stored: Sequence[Action], gap: float) -> Action | None:
        """The oldest stored ``W``, grouped with later ones of its stage while the
        group fits in ``gap`` and costs less than its single ``W`` would."""
        first = stored[0]
        single = self._duration(first)
        if single > gap + _EPS:
            return None
        limit = self._microbatches_per_w or len(stored)
        same = [w.microbatches[0] for w in stored if w.stage == first.stage][:limit]
        best = first
        for k in range(2, len(same) + 1):
            group = Action.make(first.stage, Kind.BACKWARD_WEIGHT, same[:k])
            cost = self._duration(group)
            if cost > gap + _EPS:
                break
            if cost < k * single - _EPS:
                best = group
        return best

    def stored(self, rank: int, runs: Sequence[Run]) -> list[Action]:
        """The ``W`` of ``rank`` not run yet, one per micro-batch, once ``runs``
        (what it ran) are counted.

        Both counts read the kind table's memory entries: an action that
        takes stored derivatives (``I``) leaves a ``W`` per micro-batch to
        run, one that gives them back (``W``) runs them; the micro-batches
        held go up at ``F`` and down at ``W``.
        """
        stored = self._stored[rank]
        for run in runs[self._seen[rank] :]:
            action = run.action
            self._held[rank] += action.held_change()
            if action.kind is Kind.FORWARD:
                self._forwards_left[rank] -= 1
            derivatives = action.held_change(STORED_DERIVATIVES)
            if derivatives > 0:
                stored.extend(
                    Action(action.stage, Kind.BACKWARD_WEIGHT, (mb,)) for mb in action.microbatches
                )
            elif derivatives < 0:
                done = set(action.microbatches)
                stored[:] = [
                    w for w in stored if w.stage != action.stage or w.microbatches[0] not in done
                ]
        self._seen[rank] = len(runs)
        return stored
