"""A small cost-driven list scheduler, private to the schedule layer.

Two things need predicted times inside this package: the ``paper`` and
``fill`` policies of :mod:`twobp.schedule.two_bp`, which place each ``W`` in a
slot where its rank would otherwise wait. They use this module rather than
:mod:`twobp.sim`, so that the schedule layer depends on nothing above it; any
cost model with a ``duration(action)`` method (such as
:class:`twobp.sim.CostModel`) can be passed in.

Times follow :mod:`twobp.schedule.dependencies`: an action starts when its
rank is free and what it needs is done (plus the transfer time, for a result
made on another rank). Communication actions take no time.
This module imports no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from twobp.schedule.action import Action, Kind
from twobp.schedule.dependencies import COMMUNICATION, Key, produces, requires
from twobp.schedule.schedule import Schedule
from twobp.schedule.validate import ScheduleError

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
        if a.kind in COMMUNICATION:
            return 0.0
        if kind == "B" and "B" not in table:
            return per_stage("I", a.stage) + per_stage("W", a.stage)
        return per_stage(kind, a.stage) * len(a.microbatches)

    return Timing(duration, lambda _b: 0.0)


def _arrival(
    key: Key, finished: float, rank: int, placement: Sequence[int], timing: Timing
) -> float:
    """When a result made at ``finished`` is usable on ``rank``."""
    stage, tag, _ = key
    if placement[stage] == rank:
        return finished
    boundary = stage if tag == "F" else stage - 1
    return finished + timing.transfer(boundary)


def timeline(schedule: Schedule, timing: Timing) -> dict[int, list[tuple[float, float]]]:
    """Start and end of every action of a fixed schedule.

    Args:
        schedule: a valid schedule (communication actions take no time).
        timing: the cost model.

    Returns:
        For each rank, ``(start, end)`` of each of its actions, in list order.

    Raises:
        ScheduleError: if the schedule cannot finish.
    """
    placement = schedule.placement
    finish: dict[Key, float] = {}
    spans: dict[int, list[tuple[float, float]]] = {r: [] for r in schedule.actions}
    free = dict.fromkeys(schedule.actions, 0.0)
    progress = True
    while progress:
        progress = False
        for rank, acts in schedule.actions.items():
            while len(spans[rank]) < len(acts):
                a = acts[len(spans[rank])]
                if a.kind in COMMUNICATION:
                    spans[rank].append((free[rank], free[rank]))
                    continue
                deps = requires(a, placement, lowered=False)
                if any(k not in finish for k in deps):
                    break
                start = max(
                    [free[rank]] + [_arrival(k, finish[k], rank, placement, timing) for k in deps]
                )
                end = start + timing.duration(a)
                spans[rank].append((start, end))
                free[rank] = end
                finish.update(dict.fromkeys(produces(a), end))
                progress = True
    stuck = [r for r, acts in schedule.actions.items() if len(spans[r]) < len(acts)]
    if stuck:
        raise ScheduleError(
            f"{schedule.name or 'schedule'} cannot finish: ranks {stuck} wait forever "
            "(run validate() for the rank-by-step grid)"
        )
    return spans


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
        ScheduleError: if the schedule cannot finish.
    """
    order = {r: list(acts) for r, acts in schedule.actions.items()}
    ranks = sorted(order)
    placement = schedule.placement
    producer: dict[Key, tuple[int, int]] = {}
    prefix: dict[int, list[float]] = {}
    for r in ranks:
        total = [0.0]
        for i, a in enumerate(order[r]):
            producer.update(dict.fromkeys(produces(a), (r, i)))
            total.append(total[-1] + timing.duration(a))
        prefix[r] = total
    finish: dict[Key, float] = {}
    free = dict.fromkeys(ranks, 0.0)
    pos = dict.fromkeys(ranks, 0)
    held = dict.fromkeys(ranks, 0)
    forwards_left = {r: sum(a.kind is Kind.FORWARD for a in order[r]) for r in ranks}
    stored: dict[int, deque[Action]] = {r: deque() for r in ranks}
    out: dict[int, list[Action]] = {r: [] for r in ranks}

    def ready(a: Action, rank: int) -> tuple[float, bool]:
        """When ``a`` could start at the earliest, and whether that is exact."""
        when, exact = 0.0, True
        for k in requires(a, placement, lowered=False):
            if k in finish:
                when = max(when, _arrival(k, finish[k], rank, placement, timing))
                continue
            exact = False
            pr, pi = producer[k]
            bound = free[pr] + prefix[pr][pi + 1] - prefix[pr][pos[pr]]
            when = max(when, _arrival(k, bound, rank, placement, timing))
        return when, exact

    while True:
        best: tuple[float, int, bool] | None = None  # (start, rank, is_weight)
        for r in ranks:
            if pos[r] >= len(order[r]):
                continue
            a = order[r][pos[r]]
            when, exact = ready(a, r)
            choice: tuple[float, int, bool] | None = None
            if stored[r] and (not cooldown_only or forwards_left[r] == 0):
                forced = (
                    memory_limit is not None and a.kind is Kind.FORWARD and held[r] >= memory_limit
                )
                fits = free[r] + timing.duration(stored[r][0]) <= when + _EPS
                if forced or fits:
                    choice = (free[r], r, True)
            if choice is None and exact:
                choice = (max(free[r], when), r, False)
            if choice is not None and (best is None or choice[:2] < best[:2]):
                best = choice
        if best is None:
            break
        start, r, is_weight = best
        if is_weight:
            w = stored[r].popleft()
            out[r].append(w)
            free[r] = start + timing.duration(w)
            held[r] -= 1
            continue
        a = order[r][pos[r]]
        end = start + timing.duration(a)
        finish.update(dict.fromkeys(produces(a), end))
        free[r] = end
        pos[r] += 1
        out[r].append(a)
        if a.kind is Kind.FORWARD:
            held[r] += 1
            forwards_left[r] -= 1
        else:
            stored[r].append(Action(a.stage, Kind.BACKWARD_WEIGHT, a.microbatches))
    stuck = [r for r in ranks if pos[r] < len(order[r])]
    if stuck:
        raise ScheduleError(
            f"{schedule.name or 'schedule'} cannot finish: ranks {stuck} wait forever "
            "(run validate() for the rank-by-step grid)"
        )
    for r in ranks:
        by_stage: dict[int, list[int]] = {}
        for w in stored[r]:
            by_stage.setdefault(w.stage, []).extend(w.microbatches)
        for stage in sorted(by_stage, reverse=True):
            out[r].append(Action.make(stage, Kind.BACKWARD_WEIGHT, by_stage[stage]))
    return out
