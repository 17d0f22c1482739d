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

The walk is that of :func:`twobp.sim.simulate.simulate` (dependency rules,
transfer delays, errors), with this slowdown. This module imports no torch.
"""

from __future__ import annotations

from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.result import SimResult, simulated


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
    n_ranks = schedule.n_ranks
    return simulated(schedule, costs, lambda k: slowdown(costs.contention, k, n_ranks))
