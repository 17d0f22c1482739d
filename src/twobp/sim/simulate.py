"""Event-driven simulation of a schedule under a cost model.

Every rank runs its actions in list order. An action starts as soon as its
rank is free and its inputs are there (the walk of
:mod:`twobp.schedule.walk`, with the rules of the kind table):

* ``F`` of stage ``s`` needs the forward output of stage ``s - 1`` for the
  same micro-batch (plus the transfer time if that stage is on another rank);
* ``I`` or ``B`` of stage ``s`` needs its own ``F`` and the input gradient
  produced by ``I``/``B`` of stage ``s + 1`` (plus the transfer time); the
  last stage needs only its own ``F``;
* ``W`` needs the ``I`` of every micro-batch it covers, on its stage.

Transfers are asynchronous: they do not contend, and ``SEND_*``/``RECV_*``
markers in a schedule take no time and are skipped. A transfer to another
rank occupies its sender for ``costs.send_overhead`` after the action that
made it (a CPU transport copies the message in the caller), and then arrives
after its delay.
A schedule that can never finish (a cycle of waits, or a wait for an action
no rank lists) raises :class:`DeadlockError` naming each stuck rank, with
the rank-by-step grid, as validation does.

With ``costs.contention == 1`` every action takes its fixed time from the
cost model. Otherwise ranks that compute at the same time slow each other,
and :func:`twobp.sim.contention.simulate_shared` runs the schedule instead.
This module imports no torch.
"""

from __future__ import annotations

from dataclasses import replace

from twobp.schedule.errors import DeadlockError
from twobp.schedule.schedule import Schedule
from twobp.sim.contention import simulate_shared
from twobp.sim.costs import CostModel
from twobp.sim.result import SimResult, simulated

__all__ = ["DeadlockError", "SimResult", "simulate"]


def simulate(schedule: Schedule, costs: CostModel) -> SimResult:
    """Run ``schedule`` on the clock of ``costs``.

    Args:
        schedule: the ordered actions of every rank.
        costs: a cost model with one entry per stage of the schedule (use
            :meth:`CostModel.for_stages` to fit per-rank costs to an
            interleaved schedule). With ``contention > 1``, ranks computing at
            the same time slow each other (see
            :func:`twobp.sim.contention.simulate_shared`). With ``jitter``, the
            step is simulated on :data:`JITTER_DRAWS` draws of the action times
            (seeds ``jitter_seed``, ``jitter_seed + 1``, ...) and the draw of
            median step returned.

    Returns:
        The timeline and its figures.

    Raises:
        ValueError: if the cost model has another number of stages, or a rank
            lists the same work twice.
        DeadlockError: if the schedule cannot finish; the message names every
            stuck rank, the action it is stuck on and what it waits for, and
            shows the rank-by-step grid.
    """
    if costs.jitter:
        draws = sorted(
            (_simulate_once(schedule, replace(costs, jitter_seed=costs.jitter_seed + k)))
            for k in range(JITTER_DRAWS)
        )
        return draws[len(draws) // 2][2]
    return _simulate_once(schedule, costs)[2]


JITTER_DRAWS = 9
"""Draws of a cost model with ``jitter``: :func:`simulate` returns the one of median step."""


def _simulate_once(schedule: Schedule, costs: CostModel) -> tuple[float, int, SimResult]:
    if costs.contention != 1.0:
        result = simulate_shared(schedule, costs)
    else:
        result = simulated(schedule, costs)
    return result.makespan, costs.jitter_seed, result
