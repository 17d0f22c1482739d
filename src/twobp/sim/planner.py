"""Rank schedules and 2BP policies by simulated step time, and recommend one (no torch).

:func:`evaluate` simulates each schedule with each 2BP policy (``off``,
``eager``, ``paper``, ``fill``), and optionally each recompute mode and cap on
``W`` groups (:mod:`twobp.sim.recompute`), on the same cost model. It is the
search of ``schedule="auto"`` (:mod:`twobp.sim.search`) over another part of
the one option space (:class:`twobp.sim.search.Option`: one stage count per
schedule and no cap on ``W`` actions, but recompute modes and concatenation
caps, and Chimera): the same simulation of each option, the same ranking
(:func:`twobp.sim.search.rank`: those that fit first, fastest first) and the
same chooser (:func:`twobp.sim.search.choose`), which :func:`recommend` words.
With a memory limit, the ``fill`` policy is told
how many micro-batches each rank may hold between their ``F`` and their ``W``
(see :func:`twobp.sim.memory.microbatch_limit`), so that it runs a stored
``W`` early rather than go over the limit. ``twobp plan`` prints the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twobp.schedule import SCHEDULES
from twobp.sim.candidate import (
    ALL_POLICIES,
    NO_TWO_BP,
    SEARCHED_POLICIES,
    Candidate,
    build_schedule,
    describe,
)
from twobp.sim.cost_io import format_amount
from twobp.sim.costs import CostModel
from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_AUTO, RECOMPUTE_MODES, with_recompute
from twobp.sim.search import NothingFitsError, Option, choose, rank, simulate_option

__all__ = [
    "ALL_POLICIES",
    "NO_TWO_BP",
    "SEARCHED_POLICIES",
    "Candidate",
    "build_schedule",
    "evaluate",
    "recommend",
]


def _stages_per_rank(name: str, wanted: int | None) -> int | None:
    info = SCHEDULES[name]
    allowed = info.allowed_stages_per_rank
    if wanted is None or info.default_stages_per_rank == 1:
        return None
    return wanted if allowed is None or wanted in allowed else None


def evaluate(
    costs: CostModel,
    n_ranks: int,
    n_microbatches: int,
    schedules: Sequence[str],
    policies: Sequence[str],
    stages_per_rank: int | None = None,
    memory_limit: float | None = None,
    data_parallel: int = 1,
    recomputes: Sequence[str] = (NO_RECOMPUTE,),
    weight_group_sizes: Sequence[int | None] = (None,),
) -> list[Candidate]:
    """Simulate every schedule with every policy (and recompute mode and W cap), fastest first.

    Args:
        costs: the cost model of one rank's share per stage (split for
            schedules with several stages per rank) or of every stage.
        n_ranks: number of ranks ``p``.
        n_microbatches: micro-batches per step ``m``.
        schedules: names from :data:`twobp.schedule.SCHEDULES`.
        policies: ``off`` and/or names from :data:`twobp.schedule.TWO_BP_POLICIES`.
        stages_per_rank: ``V`` for the schedules that hold several stages.
        memory_limit: memory per rank (cost-model unit); ``fill`` then keeps
            each rank to the micro-batches of :func:`twobp.sim.memory.microbatch_limit`, or
            reports why it cannot.
        data_parallel: copies of the pipeline; each stage's gradients are
            all-reduced over its replicas by an ``R`` action (see
            :func:`twobp.sim.reduction.reduction_costs`).
        recomputes: ``off`` and/or modes of :data:`twobp.sim.recompute.RECOMPUTE_MODES`,
            applied to every stage (:func:`twobp.sim.recompute.with_recompute`), and/or
            ``auto``: the stashes over ``memory_limit`` rebuilt, the fewest that fit.
        weight_group_sizes: caps on the micro-batches of one ``W`` group
            (None: no cap); each is a candidate of its own.

    Returns:
        The candidates in the order of :func:`twobp.sim.search.rank`: those
        within the memory limit by makespan (then peak memory), then those
        over it, then those that could not be built (e.g. ``m`` not a multiple
        of ``p`` for interleaved 1F1B) with their ``error``.

    Raises:
        ValueError: on an unknown schedule, policy or recompute mode name, or
            a W group cap below 1 (:func:`twobp.sim.recompute.with_recompute`).
    """
    unknown = [s for s in schedules if s not in SCHEDULES]
    unknown += [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise ValueError(
            f"unknown schedule or policy {', '.join(map(repr, unknown))}; schedules: "
            f"{', '.join(SCHEDULES)}; policies: {', '.join(ALL_POLICIES)}"
        )
    modes = (NO_RECOMPUTE, *RECOMPUTE_MODES, RECOMPUTE_AUTO)
    unknown = [r for r in recomputes if r not in modes]
    if unknown:
        raise ValueError(
            f"unknown recompute mode {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(modes)}"
        )
    for recompute in recomputes:
        for group in weight_group_sizes:
            # refuses a cap below 1 here; "auto" changes the schedule, not the costs
            with_recompute(costs, NO_RECOMPUTE if recompute == RECOMPUTE_AUTO else recompute, group)
    choices = [
        Option(name, policy, _stages_per_rank(name, stages_per_rank), None, recompute, group)
        for recompute in recomputes
        for group in weight_group_sizes
        for name in schedules
        for policy in policies
    ]
    done = [
        simulate_option(o, n_ranks, n_microbatches, costs, memory_limit, data_parallel)[0]
        for o in choices
    ]
    return rank(done, memory_limit)


def recommend(
    candidates: Sequence[Candidate],
    memory_limit: float | None,
    amount: Callable[[float], str] = format_amount,
) -> str:
    """One sentence naming the candidate to use and why.

    The choice of :func:`twobp.sim.search.choose` (the fastest that fits
    ``memory_limit``, near ties broken by the step without contention); if
    none fits, its sentence naming the one that needs the least memory.
    ``amount`` writes a memory figure with its unit (bytes by default).
    """
    ran = [c for c in candidates if c.ok]
    if not ran:
        return "Nothing could be simulated; see the errors above."
    try:
        best = choose(candidates, memory_limit)
    except NothingFitsError as exc:
        text = str(exc)
        return f"{text[:1].upper()}{text[1:]}."
    baseline = next(
        (
            c
            for c in ran
            if c.schedule == best.schedule
            and c.policy == NO_TWO_BP
            and c.recompute == NO_RECOMPUTE
            and c.weight_group_size is None
        ),
        None,
    )
    gain = (
        f", {baseline.makespan / best.makespan:.2f}x the throughput of {best.schedule} without 2BP"
        if baseline is not None and best.policy != NO_TWO_BP and best.makespan > 0
        else ""
    )
    peak = amount(best.peak_memory)
    fit = (
        f"whose peak memory per rank, {peak}, fits the limit of {amount(memory_limit)}"
        if memory_limit is not None
        else f"with a peak memory per rank of {peak} (no memory limit given)"
    )
    return (
        f"Recommended: {describe(best)}: the shortest simulated step ({best.makespan:.4g}{gain}) "
        f"{fit}."
    )
