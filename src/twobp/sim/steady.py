"""Steady state of back-to-back training steps.

:func:`twobp.sim.simulate` times one step that starts on an empty pipeline
and ends when every rank is done, as if all ranks synchronised before the
optimizer step. If they do not (each rank steps its own optimizer as soon as
its own weight passes are done, with no global gradient clipping), the next
step's forwards on the first ranks overlap the previous step's tail on the
last ranks, and the time per step falls to the *period* of the repeated
schedule. That is how ZB-H2 reaches zero bubble: each step is a
parallelogram that tiles with the next.

The period is measured by simulating the schedule repeated ``n`` times on
each rank (step ``k`` uses micro-batches ``k*m .. k*m + m - 1``), averaged
over the last repetitions. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from twobp.schedule.action import Action
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.simulate import simulate


@dataclass(frozen=True)
class SteadyState:
    """Time per step once steps run back to back without a barrier.

    Args:
        period: time between the ends of two consecutive steps.
        bubble_ratios: per rank, ``1 - busy / period``.
        bubble_ratio: mean of ``bubble_ratios``.
    """

    period: float
    bubble_ratios: tuple[float, ...]
    bubble_ratio: float


def repeat_steps(schedule: Schedule, n_steps: int) -> Schedule:
    """``schedule`` run ``n_steps`` times in a row on every rank.

    Args:
        schedule: one step.
        n_steps: how many steps, ``>= 1``.

    Returns:
        A schedule of ``n_steps * m`` micro-batches where step ``k`` is the
        original with micro-batch ``j`` renamed ``k * m + j`` (with several
        pipelines, each keeps its consecutive share of the micro-batches).

    Raises:
        ValueError: if ``n_steps < 1``.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    m = schedule.n_microbatches
    share = m // schedule.n_pipelines

    def rename(j: int, k: int) -> int:
        # Each pipeline keeps a consecutive share: its own micro-batches of every step.
        pipeline, index = divmod(j, share)
        return pipeline * share * n_steps + k * share + index

    actions = {
        rank: tuple(
            Action(a.stage, a.kind, tuple(rename(j, k) for j in a.microbatches))
            for k in range(n_steps)
            for a in acts
        )
        for rank, acts in schedule.actions.items()
    }
    return Schedule(schedule.placement, m * n_steps, actions, schedule.name, schedule.n_pipelines)


def steady_state(schedule: Schedule, costs: CostModel, *, n_steps: int = 4) -> SteadyState:
    """The period and bubble of ``schedule`` repeated without a barrier.

    Args:
        schedule: one step.
        costs: a cost model with one entry per stage.
        n_steps: steps to simulate (``>= 2``); the period is the mean time
            per step after the first.

    Returns:
        The steady state.

    Raises:
        ValueError: if ``n_steps < 2`` (and as :func:`simulate`).
        DeadlockError: as :func:`simulate`.
    """
    if n_steps < 2:
        raise ValueError(f"a steady state needs n_steps >= 2, got {n_steps}")
    one = simulate(schedule, costs)
    many = simulate(repeat_steps(schedule, n_steps), costs)
    period = (many.makespan - one.makespan) / (n_steps - 1)
    if period <= 0:
        return SteadyState(0.0, tuple(0.0 for _ in one.busy), 0.0)
    busy = one.busy
    if costs.contention != 1.0:
        # Back to back, more actions overlap and each runs slower than in a
        # lone step: the busy time per step is that of the later steps.
        busy = tuple((b - a) / (n_steps - 1) for a, b in zip(one.busy, many.busy, strict=True))
    ratios = tuple(max(0.0, 1.0 - b / period) for b in busy)
    return SteadyState(period, ratios, sum(ratios) / len(ratios))
