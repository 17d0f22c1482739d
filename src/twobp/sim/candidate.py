"""One schedule with one 2BP policy: built, fitted to its costs, simulated (no torch).

The planner (:mod:`twobp.sim.planner`) and the search
(:mod:`twobp.sim.search`) both build and simulate their combinations here,
so a schedule is costed the same way in both: :func:`build_schedule`
generates it, fits the cost model of the model's stages to it (tiled over
its pipelines, as Chimera runs two) and applies the 2BP policy;
:func:`simulate_candidate` adds the gradient reductions of replicated stages,
simulates, and reports a :class:`Candidate`, which :func:`describe` names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from twobp.schedule import SCHEDULES, TWO_BP_POLICIES, Schedule, apply_two_bp, generate
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor
from twobp.sim.memory import fill_limit
from twobp.sim.recompute import NO_RECOMPUTE
from twobp.sim.reduction import with_reductions
from twobp.sim.simulate import DeadlockError, simulate

NO_TWO_BP = "off"
"""The policy name of a schedule run as generated, without the 2BP transform."""
ALL_POLICIES = (NO_TWO_BP, *TWO_BP_POLICIES)
"""``off`` and every 2BP policy."""


@dataclass(frozen=True)
class Candidate:
    """One schedule with one 2BP policy, simulated (or why it could not be).

    Args:
        schedule: the schedule name.
        policy: the 2BP policy (``off`` for none).
        makespan: simulated step time (``inf`` if it could not run).
        bubble_ratio: mean idle fraction of the ranks.
        peak_memory: the largest peak over the ranks.
        error: why the combination could not be simulated, or ``""``.
        recompute: the recompute mode of every stage (``off`` for none).
        weight_group_size: the cap on micro-batches per ``W`` group (None: none).
        stages_per_rank: stages per rank ``V`` it was built with (None: the
            schedule's default).
        group_size: the most micro-batches one ``W`` covers (None: no cap).
        uncontended_makespan: simulated step time with ranks that do not
            slow each other (``contention = 1``); ``nan`` if not simulated.
    """

    schedule: str
    policy: str
    makespan: float = math.inf
    bubble_ratio: float = math.nan
    peak_memory: float = math.nan
    error: str = ""
    recompute: str = NO_RECOMPUTE
    weight_group_size: int | None = None
    stages_per_rank: int | None = None
    group_size: int | None = None
    uncontended_makespan: float = math.nan

    @property
    def ok(self) -> bool:
        """True if it was simulated."""
        return not self.error


def describe(c: Candidate) -> str:
    """A short name of a candidate, as the planner and ``schedule="auto"`` print it.

    For example ``zb-h2 with 2BP (fill, W groups <= 2)``,
    ``interleaved-1f1b (V=2)`` or
    ``1f1b with 2BP (paper), recompute='derivatives', weight_group_size=1``:
    the stages per rank where the schedule takes other counts, the 2BP
    policy with its cap on ``W`` groups, and the recompute options.
    """
    info = SCHEDULES.get(c.schedule)
    shown_v = (
        c.stages_per_rank is not None
        and info is not None
        and info.allowed_stages_per_rank != (c.stages_per_rank,)
    )
    label = f"{c.schedule} (V={c.stages_per_rank})" if shown_v else c.schedule
    if c.policy != NO_TWO_BP:
        cap = "" if c.group_size is None else f", W groups <= {c.group_size}"
        label += f" with 2BP ({c.policy}{cap})"
    if c.recompute != NO_RECOMPUTE:
        label += f", recompute={c.recompute!r}"
    if c.weight_group_size is not None:
        label += f", weight_group_size={c.weight_group_size}"
    return label


def uncontended(costs: CostModel) -> CostModel:
    """The same costs for ranks that do not slow each other."""
    return replace(costs, contention=1.0)


def fit_costs(costs_for: CostsFor, schedule: Schedule) -> CostModel:
    """The cost model of ``schedule``: the model cut into one pipeline's stages, per pipeline.

    Args:
        costs_for: the cost model of the model cut into a given number of stages.
        schedule: the schedule to cost.

    Returns:
        ``costs_for(stages of one pipeline)`` tiled over the schedule's pipelines.

    Raises:
        ValueError: if ``costs_for`` cannot cut the model into that many stages.
    """
    return costs_for(schedule.pipeline_stages).tile(schedule.n_pipelines)


def build_schedule(
    name: str,
    n_ranks: int,
    n_microbatches: int,
    stages_per_rank: int | None,
    two_bp: str,
    costs: CostModel | CostsFor,
    *,
    memory_limit: float | None = None,
    group_size: int | None = None,
) -> tuple[Schedule, CostModel]:
    """Generate a schedule, fit the costs to its stages and apply a 2BP policy.

    Args:
        name: a name of :data:`twobp.schedule.SCHEDULES`.
        n_ranks: number of ranks ``p``.
        n_microbatches: micro-batches per step ``m``.
        stages_per_rank: ``V`` (None: the schedule's default).
        two_bp: ``off`` or a 2BP policy.
        costs: the cost model of the model's stages (split where the
            schedule has more per pipeline), or the cost model of the model
            cut into a given number of stages (see :func:`fit_costs`).
        memory_limit: memory per rank; ``fill`` then keeps each rank to the
            micro-batches of :func:`twobp.sim.memory.fill_limit`. The other
            policies ignore it.
        group_size: the most micro-batches one ``W`` covers (None: no cap).

    Returns:
        The schedule (without gradient reductions) and its fitted cost model.

    Raises:
        ValueError: if the schedule, the policy, the costs or the memory
            limit do not fit together.
    """
    schedule = generate(name, n_ranks, n_microbatches, stages_per_rank=stages_per_rank)
    fitted = fit_costs(costs.for_stages if isinstance(costs, CostModel) else costs, schedule)
    if two_bp != NO_TWO_BP:
        held = None
        if two_bp == "fill" and memory_limit is not None:
            held = fill_limit(schedule, fitted, memory_limit)
        schedule = apply_two_bp(
            schedule, two_bp, costs=fitted, memory_limit=held, group_size=group_size
        )
    return schedule, fitted


def simulate_candidate(
    name: str,
    policy: str,
    n_ranks: int,
    n_microbatches: int,
    costs: CostModel | CostsFor,
    *,
    stages_per_rank: int | None = None,
    group_size: int | None = None,
    memory_limit: float | None = None,
    data_parallel: int = 1,
) -> tuple[Candidate, Schedule | None]:
    """Build one combination (:func:`build_schedule`), add its reductions and simulate it.

    Each stage held by several ranks (``data_parallel`` copies, and the
    pipelines of the schedule) all-reduces its gradients
    (:func:`twobp.sim.reduction.with_reductions`). Contended costs are also
    simulated without contention (``uncontended_makespan``).

    Args:
        name, policy, n_ranks, n_microbatches, costs, stages_per_rank,
            group_size, memory_limit: as for :func:`build_schedule`.
        data_parallel: copies of the pipeline ``D``.

    Returns:
        The candidate (with ``error`` if it cannot be built or run; with the
        stages per rank it ran with) and its schedule (None on error).
    """
    base = Candidate(name, policy, stages_per_rank=stages_per_rank, group_size=group_size)
    try:
        schedule, fitted = build_schedule(
            name,
            n_ranks,
            n_microbatches,
            stages_per_rank,
            policy,
            costs,
            memory_limit=memory_limit,
            group_size=group_size,
        )
        schedule, fitted = with_reductions(schedule, fitted, data_parallel)
        result = simulate(schedule, fitted)
        alone = result if fitted.contention == 1 else simulate(schedule, uncontended(fitted))
    except (ValueError, DeadlockError) as exc:
        return replace(base, error=str(exc).splitlines()[0]), None
    candidate = replace(
        base,
        makespan=result.makespan,
        bubble_ratio=result.bubble_ratio,
        peak_memory=max(result.peak_memory),
        stages_per_rank=schedule.pipeline_stages // schedule.n_ranks,
        uncontended_makespan=alone.makespan,
    )
    return candidate, schedule
