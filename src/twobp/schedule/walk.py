"""The schedule walker: the one loop that runs a schedule's action lists in time.

Every rank runs its actions in list order. An action starts once its rank is
free and every result it requires (the rules of
:mod:`twobp.schedule.dependencies`) has arrived: a result made on the same
rank arrives when it is made, one made on another rank ``transfer(b)`` later
(``b`` the stage boundary it crosses). Validation, the 2BP weight placement
and both simulators are this walk with other durations:

* the dry-run of :func:`twobp.schedule.validate.dry_run`: every action takes
  one step, transfer actions included (``lowered=True``);
* the 2BP placement (``twobp.schedule.two_bp``): predicted times, and a
  ``fill`` that runs a stored ``W`` where a rank would wait;
* ``twobp.sim.simulate``: the cost model's times and transfer delays;
  transfer actions take no time and are skipped (``lowered=False``);
* ``twobp.sim.contention``: the same with a ``slowdown`` that depends on how
  many ranks compute at once.

An action of a *background* kind (``R``, an asynchronous all-reduce) takes
its time beside its rank's compute: the rank goes on at once.

Two clocks. With fixed durations an action ends ``duration(action)`` after
it starts, and actions run in order of start time (ties: lower rank first).
With a ``slowdown``, ``k`` ranks computing at once each progress at
``1 / slowdown(k)`` of their alone speed; time advances from event to event
(an action ends, or one's inputs arrive). Every run also gets its lock-step
*step*: the round it would run in if every action took one round, which is
what a deadlock's grid shows. This module imports no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from twobp.schedule.action import Action
from twobp.schedule.dependencies import (
    Key,
    describe_wait,
    index_producers,
    produces,
    requires,
)
from twobp.schedule.errors import DeadlockError, format_grid
from twobp.schedule.kinds import kind_spec
from twobp.schedule.schedule import Schedule

# An action whose work left is below this fraction of its work is done: float
# rounding of many small steps must not leave a remainder that never reaches 0.
_FINISH_TOLERANCE = 1e-12

Grid = list[tuple[Action | None, ...]]
"""One row per lock-step step, one cell per rank: the action run then, or None."""


@dataclass(frozen=True)
class Run:
    """One action as the walk ran it.

    Args:
        action: the action.
        start: when it started.
        end: when it ended.
        step: its lock-step round (see the module docstring).
    """

    action: Action
    start: float
    end: float
    step: int


@dataclass(frozen=True)
class Walk:
    """What a walk ran.

    Args:
        ranks: the ranks, in increasing order.
        runs: for each rank, its runs in the order they ran (skipped
            transfer actions are absent; actions a ``fill`` added are in).
    """

    ranks: tuple[int, ...]
    runs: Mapping[int, tuple[Run, ...]]

    def grid(self) -> Grid:
        """The lock-step grid: row ``t`` holds the action each rank ran at step ``t``."""
        return _grid(self.ranks, self.runs)


class Walker:
    """The state of a walk, as a ``fill`` sees it.

    A ``fill(walker, rank)`` is asked, each time the walk looks for the next
    action to run, whether ``rank`` should run something else first; it
    reads the state through :meth:`next_action`, :meth:`free_at`,
    :meth:`earliest_start` and :meth:`runs`.
    """

    def __init__(
        self,
        schedule: Schedule,
        duration: Callable[[Action], float],
        transfer: Callable[[int], float] | None,
        lowered: bool,
    ) -> None:
        self._schedule = schedule
        self._duration = duration
        self._transfer = transfer
        self._lowered = lowered
        self.ranks = tuple(sorted(schedule.actions))
        self._producer = index_producers(schedule, lowered)
        # Per rank, what it walks: (index in its list, action, what it requires).
        self._lists = {
            r: [
                (i, a, requires(a, schedule.graph, lowered), produces(a))
                for i, a in enumerate(schedule.actions[r])
                if lowered or a.kind.is_compute
            ]
            for r in self.ranks
        }
        self._position = dict.fromkeys(self.ranks, 0)
        self._free = dict.fromkeys(self.ranks, 0.0)
        self._made: dict[Key, tuple[float, int]] = {}  # key -> (end, step) of its producer
        self._runs: dict[int, list[Run]] = {r: [] for r in self.ranks}
        self._prefix: dict[int, list[float]] | None = None

    def next_action(self, rank: int) -> Action | None:
        """The next listed action of ``rank`` (None when done); unlowered, transfers are skipped."""
        listed = self._lists[rank]
        position = self._position[rank]
        return listed[position][1] if position < len(listed) else None

    def free_at(self, rank: int) -> float:
        """When ``rank`` ends what it has started."""
        return self._free[rank]

    def runs(self, rank: int) -> Sequence[Run]:
        """What ``rank`` has run (or started) so far, in order."""
        return self._runs[rank]

    def ready_at(self, rank: int) -> float | None:
        """When every input of the next action of ``rank`` is there, or None if
        one is not made yet; the rank's own availability is not counted."""
        listed = self._lists[rank]
        position = self._position[rank]
        if position == len(listed):
            return None
        _, action, needs, _ = listed[position]
        when = 0.0
        for key in needs:
            made = self._made.get(key)
            if made is None:
                return None
            when = max(when, self._arrival(key, made[0], action.stage))
        return when

    def missing_input(self, rank: int) -> Key | None:
        """An input of the next action of ``rank`` not made yet (None: all are, or none is next)."""
        listed = self._lists[rank]
        position = self._position[rank]
        if position == len(listed):
            return None
        made = self._made
        return next((key for key in listed[position][2] if key not in made), None)

    def earliest_start(self, rank: int) -> float:
        """A lower bound of :meth:`ready_at`, also for inputs not made yet: their
        producer's rank runs its list from now on without waiting."""
        _, action, needs, _ = self._lists[rank][self._position[rank]]
        prefix = self._prefix_durations()
        when = 0.0
        for key in needs:
            if key in self._made:
                made = self._made[key][0]
            elif key in self._producer:
                pr, pi = self._producer[key]
                made = self._free[pr] + prefix[pr][pi + 1] - prefix[pr][self._index(pr)]
            else:
                made = float("inf")
            when = max(when, self._arrival(key, made, action.stage))
        return when

    def take(self, rank: int) -> Action:
        """Move past the next action of ``rank`` and return it."""
        action = self.next_action(rank)
        assert action is not None, f"rank {rank} has nothing left to run"
        self._position[rank] += 1
        return action

    def next_needs(self, rank: int) -> tuple[tuple[Key, ...], tuple[Key, ...]]:
        """The inputs and the results of the next action of ``rank`` (as :func:`requires`
        and :func:`produces` give them)."""
        _, _, needs, made = self._lists[rank][self._position[rank]]
        return needs, made

    def finish(
        self,
        rank: int,
        action: Action,
        start: float,
        end: float,
        known: tuple[tuple[Key, ...], tuple[Key, ...]] | None = None,
    ) -> tuple[Key, ...]:
        """Record that ``rank`` ran ``action`` from ``start`` to ``end``; returns what it made.

        ``known``: the action's inputs and results where the caller has them
        (:meth:`next_needs`).
        """
        needs, made = known if known is not None else (self._requires(action), produces(action))
        steps = [self._made[k][1] for k in needs if k in self._made]
        last = self._runs[rank][-1].step if self._runs[rank] else -1
        step = max([last, *steps]) + 1
        self._runs[rank].append(Run(action, start, end, step))
        # A background action (a gradient reduction) leaves its rank free at once.
        self._free[rank] = start if kind_spec(action.kind).background else end
        for key in made:
            self._made[key] = (end, step)
        return made

    def deadlock(self) -> DeadlockError:
        """The error for a walk that cannot go on, with every stuck rank and the grid."""
        stuck: dict[int, Action | None] = {}
        reasons: list[str] = []
        for rank in self.ranks:
            action = stuck[rank] = self.next_action(rank)
            if action is None:
                continue
            missing = [k for k in self._requires(action) if k not in self._made]
            waits = "; ".join(describe_wait(k, self._producer) for k in missing)
            reasons.append(
                f"  rank {rank} is stuck at {action} (its action #{self._index(rank)}): "
                f"waits for {waits}"
            )
        grid = _grid(self.ranks, self._runs)
        return DeadlockError(
            f"{self._schedule.name or 'schedule'} deadlocks at step {len(grid)}: no rank can "
            "run its next action.\n"
            + "\n".join(reasons)
            + "\nReorder the actions so that each one comes after what it waits for.\n"
            + format_grid(grid, self.ranks, stuck)
        )

    def result(self) -> Walk:
        """The walk so far."""
        return Walk(self.ranks, {r: tuple(runs) for r, runs in self._runs.items()})

    def _requires(self, action: Action) -> tuple[Key, ...]:
        schedule = self._schedule
        return requires(action, schedule.graph, self._lowered)

    def _index(self, rank: int) -> int:
        """The index in its list of the next action of ``rank`` (its length when done)."""
        listed = self._lists[rank]
        position = self._position[rank]
        return listed[position][0] if position < len(listed) else len(self._schedule.actions[rank])

    def _arrival(self, key: Key, made: float, stage: int) -> float:
        """When a result made at ``made`` is usable by an action of ``stage``."""
        placement = self._schedule.placement
        if self._transfer is None or placement[key[0]] == placement[stage]:
            return made
        return made + self._transfer(min(key[0], stage))

    def _prefix_durations(self) -> dict[int, list[float]]:
        if self._prefix is None:
            self._prefix = {}
            for rank in self.ranks:
                total = [0.0]
                for a in self._schedule.actions[rank]:
                    busy = not kind_spec(a.kind).background
                    total.append(total[-1] + (self._duration(a) if busy else 0.0))
                self._prefix[rank] = total
        return self._prefix


Fill = Callable[[Walker, int], Action | None]
"""Asked for a rank with actions left: an action to run first, at once, or None."""


def walk(
    schedule: Schedule,
    duration: Callable[[Action], float],
    *,
    transfer: Callable[[int], float] | None = None,
    slowdown: Callable[[int], float] | None = None,
    fill: Fill | None = None,
    lowered: bool = False,
) -> Walk:
    """Run every rank's actions in order, each as soon as its rank and inputs allow.

    Args:
        schedule: the schedule.
        duration: the time of an action alone.
        transfer: the delay of a result crossing boundary ``b -> b + 1``
            between two ranks; ``None``: none.
        slowdown: how many times slower every running action goes while
            ``k`` ranks compute at once; ``None``: fixed durations.
        fill: with fixed durations, extra work a rank may run where it would
            wait (see :class:`Walker`); its actions are in the runs.
        lowered: walk transfer actions with their rules (a receive waits for
            its send); otherwise skip them and let results cross directly.

    Returns:
        Every run, per rank.

    Raises:
        DeadlockError: if some rank can never run its next action; the
            message names each stuck rank, the action, what it waits for and
            where that is listed, then shows the grid.
        ScheduleError: if two actions make the same result.
        ValueError: if both ``slowdown`` and ``fill`` are given.
    """
    walker = Walker(schedule, duration, transfer, lowered)
    if slowdown is None:
        _walk_fixed(walker, duration, fill)
    elif fill is not None:
        raise ValueError("a fill runs with fixed durations only; pass slowdown or fill")
    else:
        _walk_shared(walker, duration, slowdown)
    if any(walker.next_action(r) is not None for r in walker.ranks):
        raise walker.deadlock()
    return walker.result()


def _walk_fixed(walker: Walker, duration: Callable[[Action], float], fill: Fill | None) -> None:
    """Start, one at a time, the action that can start earliest."""
    if fill is None:
        _walk_listed(walker, duration)
        return
    while True:
        best: tuple[float, int, Action, bool] | None = None  # start, rank, action, listed
        for rank in walker.ranks:
            action = walker.next_action(rank)
            if action is None:
                continue
            # A fill's action starts when its rank became free, which may be
            # before starts already chosen elsewhere: it occupies only that rank.
            extra = fill(walker, rank) if fill is not None else None
            if extra is not None:
                choice = (walker.free_at(rank), rank, extra, False)
            else:
                ready = walker.ready_at(rank)
                if ready is None:
                    continue
                choice = (max(walker.free_at(rank), ready), rank, action, True)
            if best is None or choice[:2] < best[:2]:
                best = choice
        if best is None:
            return
        start, rank, action, listed = best
        if listed:
            walker.take(rank)
        walker.finish(rank, action, start, start + duration(action))


def _walk_listed(walker: Walker, duration: Callable[[Action], float]) -> None:
    """:func:`_walk_fixed` without a fill, in time linear in the actions.

    A rank whose next action has every input is on a heap by its start, which
    changes only when the rank runs that action (results are made once). A rank
    that misses an input waits under that input's key, and is asked again when
    it is made. So each pick is the earliest (start, rank), as a scan of every
    rank would find, without asking every rank each time.
    """
    ready: list[tuple[float, int]] = []
    waiting: dict[Key, list[int]] = {}

    def ask(rank: int) -> None:
        if walker.next_action(rank) is None:
            return
        missing = walker.missing_input(rank)
        if missing is not None:
            waiting.setdefault(missing, []).append(rank)
            return
        when = walker.ready_at(rank)
        assert when is not None
        heapq.heappush(ready, (max(walker.free_at(rank), when), rank))

    for rank in walker.ranks:
        ask(rank)
    while ready:
        start, rank = heapq.heappop(ready)
        known = walker.next_needs(rank)
        action = walker.take(rank)
        made = walker.finish(rank, action, start, start + duration(action), known)
        ask(rank)
        for key in made:
            for other in waiting.pop(key, ()):
                ask(other)


@dataclass
class _Running:
    """An action in progress on a rank: when it started and the work left."""

    action: Action
    start: float
    work: float
    left: float


def _walk_shared(
    walker: Walker, duration: Callable[[Action], float], slowdown: Callable[[int], float]
) -> None:
    """Advance time event by event, every running action at the shared rate."""
    running: dict[int, _Running] = {}
    now = 0.0

    def ready(rank: int) -> float | None:
        when = walker.ready_at(rank)
        return None if when is None else max(now, when)

    while True:
        # Start every action whose inputs are there; one of no work ends at
        # once and may free the way for another at the same instant.
        started = True
        while started:
            started = False
            for rank in walker.ranks:
                if rank in running or ready(rank) != now:
                    continue
                action = walker.take(rank)
                work = duration(action)
                if kind_spec(action.kind).background:
                    walker.finish(rank, action, now, now + work)
                elif work > 0:
                    running[rank] = _Running(action, now, work, work)
                else:
                    walker.finish(rank, action, now, now)
                started = True

        arrivals = [t for r in walker.ranks if r not in running and (t := ready(r)) is not None]
        if not running and not arrivals:
            return
        factor = slowdown(len(running))
        end_at = {r: now + run.left * factor for r, run in running.items()}
        step_to = min([*end_at.values(), *arrivals])
        elapsed = step_to - now
        now = step_to
        for rank, run in list(running.items()):
            run.left -= elapsed / factor
            if end_at[rank] <= now or run.left <= _FINISH_TOLERANCE * run.work:
                del running[rank]
                walker.finish(rank, run.action, run.start, now)


def _grid(ranks: Sequence[int], runs: Mapping[int, Sequence[Run]]) -> Grid:
    n_steps = 1 + max((run.step for r in ranks for run in runs[r]), default=-1)
    rows: list[list[Action | None]] = [[None] * len(ranks) for _ in range(n_steps)]
    for column, rank in enumerate(ranks):
        for run in runs[rank]:
            rows[run.step][column] = run.action
    return [tuple(row) for row in rows]
