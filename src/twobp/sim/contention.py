"""Simulation of ranks that slow each other while they compute at once.

On one CPU machine, pipeline ranks share cores, caches and memory bandwidth:
two ranks computing at the same time each run slower than one alone. With a
fixed time per action the simulator cannot tell a schedule whose actions
mostly run alone (large bubbles, fast actions) from one whose actions mostly
overlap (no bubbles, slow actions). :func:`simulate_shared` tells them apart.

Each action has an amount of *work*: its time alone, from the cost model.
While ``k`` of the ``n`` ranks compute, each running action does its work at
the rate ``1 / slowdown(k)``, where ``slowdown(k) = 1 + (c - 1)(k - 1)/(n - 1)``
and ``c`` is ``costs.contention``. Between two events (an action ends, or an
action's inputs arrive) ``k`` is constant, so time advances event by event
(a fluid model). Two ranks, ``c = 2``: ``A`` (work 3) starts at 0 on rank 0,
``B`` (work 1) becomes ready at 1 on rank 1::

    time     0     1     2     3     4
    rank 0   [alone][ A with B  ][alone]   A: 1 + 1 + 1 work, ends at 4 (not 3)
    rank 1          [ B with A  ]          B: 1 work at half speed, ends at 3

The dependency rules, the transfer delays and the errors are those of
:func:`twobp.sim.simulate.simulate`. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from twobp.schedule.action import Action
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.deps import (
    DeadlockError,
    Key,
    check_stage_count,
    deadlock_message,
    dependencies,
    index_producers,
    products,
)
from twobp.sim.result import SimResult, summarise
from twobp.timeline import Span

# An action whose work left is below this fraction of its work is done: float
# rounding of many small steps must not leave a remainder that never reaches 0.
_FINISH_TOLERANCE = 1e-12


def slowdown(contention: float, computing: int, n_ranks: int) -> float:
    """How many times slower each action runs while ``computing`` ranks compute.

    Args:
        contention: the slowdown with every rank computing
            (:attr:`CostModel.contention`).
        computing: how many ranks compute at this moment.
        n_ranks: how many ranks the pipeline has.

    Returns:
        ``1 + (contention - 1) * (computing - 1) / (n_ranks - 1)``, or 1 if
        ``n_ranks <= 1`` or ``computing <= 1``.
    """
    if n_ranks <= 1 or computing <= 1:
        return 1.0
    return 1.0 + (contention - 1.0) * (computing - 1) / (n_ranks - 1)


@dataclass
class _Running:
    """An action in progress on a rank: when it started and the work left."""

    action: Action
    start: float
    work: float
    left: float


def simulate_shared(schedule: Schedule, costs: CostModel) -> SimResult:
    """Run ``schedule`` with ranks that slow each other while computing at once.

    Each rank runs its compute actions in list order; an action starts when
    its rank is free and its inputs are there (as in
    :func:`twobp.sim.simulate.simulate`), and progresses at
    ``1 / slowdown(k)`` of its alone speed while ``k`` ranks compute (see
    :func:`slowdown`). With ``costs.contention == 1`` the timeline equals the
    one of :func:`~twobp.sim.simulate.simulate` up to float rounding.

    Args:
        schedule: the ordered actions of every rank.
        costs: a cost model with one entry per stage of the schedule; its
            times are the alone times.

    Returns:
        The timeline and its figures; a span lasts its slowed time, so busy
        time includes the slowdown.

    Raises:
        ValueError: if the cost model has another number of stages, or a rank
            lists the same work twice.
        DeadlockError: if the schedule cannot finish; the message names every
            stuck rank, the action it is stuck on and what it waits for.
    """
    check_stage_count(schedule, costs)
    producer = index_producers(schedule)
    ranks = sorted(schedule.actions)
    ends: dict[Key, float] = {}
    position = dict.fromkeys(ranks, 0)
    running: dict[int, _Running] = {}
    spans: list[Span] = []
    now = 0.0

    def ready_at(rank: int) -> float | None:
        """When the next compute action of an idle rank may start (None: not known yet)."""
        actions = schedule.actions[rank]
        while position[rank] < len(actions) and not actions[position[rank]].kind.is_compute:
            position[rank] += 1  # communication markers take no time
        if position[rank] == len(actions):
            return None
        ready = now
        for key, delay in dependencies(actions[position[rank]], schedule, costs):
            if key not in ends:
                return None
            ready = max(ready, ends[key] + delay)
        return ready

    def finish(rank: int, run: _Running) -> None:
        spans.append(Span(rank, run.action, run.start, now))
        for key in products(run.action):
            ends[key] = now

    while True:
        # Start every action whose inputs are there; one of no work ends at
        # once and may free the way for another at the same instant.
        started = True
        while started:
            started = False
            for rank in ranks:
                if rank in running or ready_at(rank) != now:
                    continue
                action = schedule.actions[rank][position[rank]]
                position[rank] += 1
                work = costs.duration(action)
                run = _Running(action, now, work, work)
                if work > 0:
                    running[rank] = run
                else:
                    finish(rank, run)
                started = True

        arrivals = [t for r in ranks if r not in running and (t := ready_at(r)) is not None]
        if not running and not arrivals:
            break
        factor = slowdown(costs.contention, len(running), schedule.n_ranks)
        end_at = {r: now + run.left * factor for r, run in running.items()}
        step_to = min([*end_at.values(), *arrivals])
        elapsed = step_to - now
        now = step_to
        for rank, run in list(running.items()):
            run.left -= elapsed / factor
            if end_at[rank] <= now or run.left <= _FINISH_TOLERANCE * run.work:
                del running[rank]
                finish(rank, run)

    stuck = [r for r in ranks if position[r] < len(schedule.actions[r])]
    if stuck:
        raise DeadlockError(deadlock_message(schedule, costs, stuck, position, ends, producer))
    return summarise(schedule, costs, spans)
