"""Rank schedules and 2BP policies by simulated step time, and recommend one (no torch).

:func:`evaluate` simulates each schedule with each 2BP policy (``off``,
``eager``, ``paper``, ``fill``), and optionally each recompute mode and cap on
``W`` groups (:mod:`twobp.sim.recompute`), on the same cost model and orders
them from the shortest step to the longest; :func:`recommend` names the fastest whose peak
memory fits a per-rank limit. With a memory limit, the ``fill`` policy is told
how many micro-batches each rank may hold between their ``F`` and their ``W``
(see :func:`twobp.sim.memory.microbatch_limit`), so that it runs a stored
``W`` early rather than go over the limit. ``twobp plan`` prints the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from twobp.schedule import SCHEDULES
from twobp.sim.candidate import (
    ALL_POLICIES,
    NO_TWO_BP,
    Candidate,
    build_schedule,
    describe,
    simulate_candidate,
)
from twobp.sim.cost_io import format_amount
from twobp.sim.costs import CostModel
from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_MODES, with_recompute

__all__ = [
    "ALL_POLICIES",
    "NO_TWO_BP",
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
            applied to every stage (:func:`twobp.sim.recompute.with_recompute`).
        weight_group_sizes: caps on the micro-batches of one ``W`` group
            (None: no cap); each is a candidate of its own.

    Returns:
        The candidates ordered by makespan, then peak memory; those that could
        not be built (e.g. ``m`` not a multiple of ``p`` for interleaved 1F1B)
        come last with their ``error``.

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
    modes = (NO_RECOMPUTE, *RECOMPUTE_MODES)
    unknown = [r for r in recomputes if r not in modes]
    if unknown:
        raise ValueError(
            f"unknown recompute mode {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(modes)}"
        )
    out = []
    for recompute in recomputes:
        for group in weight_group_sizes:
            variant = with_recompute(costs, recompute, group)
            for c in _evaluate_variant(
                variant,
                n_ranks,
                n_microbatches,
                schedules,
                policies,
                stages_per_rank,
                memory_limit,
                data_parallel,
            ):
                out.append(replace(c, recompute=recompute, weight_group_size=group))
    return sorted(out, key=lambda c: (not c.ok, c.makespan, c.peak_memory))


def _evaluate_variant(
    costs: CostModel,
    n_ranks: int,
    n_microbatches: int,
    schedules: Sequence[str],
    policies: Sequence[str],
    stages_per_rank: int | None,
    memory_limit: float | None,
    data_parallel: int = 1,
) -> list[Candidate]:
    """The candidates of one cost model (one recompute mode and W cap)."""
    return [
        simulate_candidate(
            name,
            policy,
            n_ranks,
            n_microbatches,
            costs,
            stages_per_rank=_stages_per_rank(name, stages_per_rank),
            memory_limit=memory_limit,
            data_parallel=data_parallel,
        )[0]
        for name in schedules
        for policy in policies
    ]


def recommend(candidates: Sequence[Candidate], memory_limit: float | None) -> str:
    """One sentence naming the candidate to use and why.

    The fastest candidate whose peak memory fits ``memory_limit``; if none
    fits, the one that needs the least memory.
    """
    ran = [c for c in candidates if c.ok]
    if not ran:
        return "Nothing could be simulated; see the errors above."
    fits = [c for c in ran if memory_limit is None or c.peak_memory <= memory_limit]
    if not fits:
        least = min(ran, key=lambda c: (c.peak_memory, c.makespan))
        return (
            f"Nothing fits in {format_amount(memory_limit or 0)} per rank: {describe(least)} needs "
            f"the least ({format_amount(least.peak_memory)}); use fewer micro-batches in flight, "
            "more ranks or a higher limit."
        )
    best = fits[0]
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
    limit = (
        f"fits the limit of {format_amount(memory_limit)}"
        if memory_limit is not None
        else "(no memory limit given)"
    )
    return (
        f"Recommended: {describe(best)}: the shortest simulated step ({best.makespan:.4g}{gain}) "
        f"whose peak memory per rank ({format_amount(best.peak_memory)}) {limit}."
    )
