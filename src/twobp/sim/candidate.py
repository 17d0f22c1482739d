"""One schedule with one 2BP policy: built, fitted to its costs, simulated (no torch).

The planner (:mod:`twobp.sim.planner`) and the search
(:mod:`twobp.sim.search`) both build and simulate their combinations here,
so a schedule is costed the same way in both: :func:`build_schedule`
takes it from the preparation pass (:mod:`twobp.schedule.prepare`, as the
runtime does), fitting the cost model of the model's stages to it (tiled
over its pipelines, as Chimera runs two) before its 2BP placement, and times
its gradient reductions; :func:`simulate_candidate` simulates it and reports
a :class:`Candidate`, which :func:`describe` names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from twobp.schedule import SCHEDULES, TWO_BP_POLICIES, Schedule, is_split
from twobp.schedule.lowering import split_stages
from twobp.schedule.prepare import finish_schedule, reduces, source_schedule
from twobp.schedule.two_bp import DYNAMIC
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor
from twobp.sim.memory import fill_limit
from twobp.sim.rebuild import fewest_rebuilds, rebuild_count
from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_AUTO
from twobp.sim.reduction import reduction_costs
from twobp.sim.simulate import DeadlockError, simulate

NO_TWO_BP = "off"
"""The policy name of a schedule run as generated, without the 2BP transform."""
ALL_POLICIES = (NO_TWO_BP, *TWO_BP_POLICIES)
"""``off`` and every 2BP policy."""
SEARCHED_POLICIES = tuple(p for p in ALL_POLICIES if p != DYNAMIC)
"""The policies a search compares unless told otherwise: all but ``dynamic``, whose
gain over ``fill`` is the run-time spread of the costs (a cost model's ``jitter``),
which a profile does not measure; name it to compare it."""


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
        microbatches_per_w: the most micro-batches one ``W`` action covers
            (None: no cap); not the engine's ``weight_group_size``.
        uncontended_makespan: simulated step time with ranks that do not
            slow each other (``contention = 1``); ``nan`` if not simulated.
        n_microbatches: the micro-batches the batch is cut into, where the
            search chose that too (``n_microbatches="auto"``); None otherwise.
        rebuilds: how many stashes its schedule rebuilds instead of keeping
            (``recompute="auto"``: its ``IR`` and ``WR`` actions).
        split: per stage of the model, True where its backward is split
            (None: every stage alike, as ``policy`` says).
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
    microbatches_per_w: int | None = None
    uncontended_makespan: float = math.nan
    n_microbatches: int | None = None
    rebuilds: int = 0
    split: tuple[bool, ...] | None = None

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
    policy with its cap on ``W`` groups, the recompute options, and the
    micro-batch count where the search chose it (``, m=4``).
    """
    info = SCHEDULES.get(c.schedule)
    shown_v = (
        c.stages_per_rank is not None
        and info is not None
        and info.allowed_stages_per_rank != (c.stages_per_rank,)
    )
    label = f"{c.schedule} (V={c.stages_per_rank})" if shown_v else c.schedule
    if c.policy != NO_TWO_BP:
        cap = "" if c.microbatches_per_w is None else f", W groups <= {c.microbatches_per_w}"
        label += f" with 2BP ({c.policy}{cap})"
        if c.split is not None and not all(c.split):
            on = [str(s) for s, b in enumerate(c.split) if b]
            label += f" on stages {', '.join(on)}" if on else " on no stage"
    if c.recompute != NO_RECOMPUTE:
        label += f", recompute={c.recompute!r}"
        if c.recompute == RECOMPUTE_AUTO:
            label += f" ({c.rebuilds} rebuilt)"
    if c.weight_group_size is not None:
        label += f", weight_group_size={c.weight_group_size}"
    if c.n_microbatches is not None:
        label += f", m={c.n_microbatches}"
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


def _fitted(costs: CostModel | CostsFor, schedule: Schedule) -> CostModel:
    """``costs`` fitted to ``schedule`` (:func:`fit_costs`); a cost model with a stage
    for each stage of every pipeline is fitted already."""
    if isinstance(costs, CostModel):
        if schedule.n_pipelines > 1 and costs.n_stages == schedule.n_stages:
            return costs
        return fit_costs(costs.for_stages, schedule)
    return fit_costs(costs, schedule)


def timed_costs(schedule: Schedule, fitted: CostModel, data_parallel: int = 1) -> CostModel:
    """The costs a prepared schedule is simulated under: ``fitted`` (:func:`fit_costs`)
    with its reductions timed over ``data_parallel`` copies, and its fused stages'
    ``F`` without the 2BP engine (a profile measures both)."""
    return reduction_costs(schedule, fitted, data_parallel).for_split(split_stages(schedule))


def build_schedule(
    name: str,
    n_ranks: int,
    n_microbatches: int,
    stages_per_rank: int | None,
    policy: str,
    costs: CostModel | CostsFor,
    *,
    memory_limit: float | None = None,
    microbatches_per_w: int | None = None,
    data_parallel: int = 1,
    tied: bool = False,
    rebuild_within: float | None = None,
    split: tuple[bool, ...] | None = None,
    source: Schedule | None = None,
    reduce: bool | None = None,
) -> tuple[Schedule, CostModel]:
    """The schedule a pipeline would run, through the preparation pass, and its costs.

    :func:`twobp.schedule.prepare.source_schedule` generates it, the costs
    are fitted to its stages, and :func:`twobp.schedule.prepare.finish_schedule`
    applies the 2BP policy with them, fuses the first stage's ``I`` and ``W``
    and places the reductions: the same schedule, action for action, as
    ``Pipeline(schedule=name, ...)`` runs with these options.

    Args:
        name: a name of :data:`twobp.schedule.SCHEDULES`.
        n_ranks: number of ranks ``p``.
        n_microbatches: micro-batches per step ``m``.
        stages_per_rank: ``V`` (None: the schedule's default).
        policy: ``off`` or a 2BP policy.
        costs: the cost model of the model's stages (split where the
            schedule has more per pipeline), or the cost model of the model
            cut into a given number of stages (see :func:`fit_costs`).
        memory_limit: memory per rank; ``fill`` then keeps each rank to the
            micro-batches of :func:`twobp.sim.memory.fill_limit`. The other
            policies ignore it.
        microbatches_per_w: the most micro-batches one ``W`` action covers (None: no cap).
        data_parallel: copies of the pipeline ``D``: with more than one (or
            several pipelines), every stage reduces its gradients, timed by
            :func:`twobp.sim.reduction.reduction_costs`.
        tied: some weight is used by several blocks (its stages reduce it).
        rebuild_within: a memory limit per rank that the stashes over it are
            rebuilt to fit (:func:`twobp.sim.rebuild.fewest_rebuilds`,
            ``recompute="auto"``); None: every stash is kept.
        split: per stage of the model, True where its backward is split
            (``two_bp`` as a list); None: every stage under a policy, as
            generated with ``off``. Needs a policy.
        source: the sourced schedule to prepare instead of generating
            ``name``, as a pipeline given it prepares it: a split schedule
            keeps its own ``W`` placement. ``costs`` may then be fitted to
            its stages already (a stage per stage of every pipeline).
        reduce: whether the stages reduce their gradients (``R``); None:
            :func:`twobp.schedule.prepare.reduces` says.

    Returns:
        The prepared schedule (with its reductions) and its fitted cost model.

    Raises:
        ValueError: if the schedule, the policy, the costs or the memory
            limit do not fit together.
    """
    if policy != NO_TWO_BP and policy not in TWO_BP_POLICIES:
        raise ValueError(
            f"unknown 2BP policy {policy!r}; use {NO_TWO_BP!r} or one of "
            f"{', '.join(TWO_BP_POLICIES)}"
        )
    if split is not None and policy == NO_TWO_BP:
        raise ValueError(f"stages split {list(split)} need a 2BP policy, not {NO_TWO_BP!r}")
    if source is None and split is None and policy in COST_FREE_POLICIES:
        sourced, prepared = _prepared_without_costs(
            name,
            n_ranks,
            n_microbatches,
            stages_per_rank,
            policy,
            microbatches_per_w,
            # Whether the copies reduce is all the schedule takes from their number.
            min(data_parallel, 2),
            tied,
            reduce,
        )
        return _rebuilt(prepared, _fitted(costs, sourced), data_parallel, rebuild_within)
    schedule = source
    if schedule is None:
        schedule = source_schedule(
            name, n_ranks=n_ranks, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
        )
    fitted = _fitted(costs, schedule)
    held = None
    if policy in ("fill", DYNAMIC) and memory_limit is not None:
        held = fill_limit(schedule, fitted, memory_limit)
    # "off" runs the schedule as generated: fused stays fused, a zb-* keeps its own W;
    # a policy places the W of any schedule, a zb-* included.
    placed = policy != NO_TWO_BP
    prepared = finish_schedule(
        schedule,
        two_bp=split if split is not None else placed or is_split(schedule),
        policy=policy if placed else "paper",
        costs=fitted,
        held=held,
        microbatches_per_w=microbatches_per_w if placed else None,
        reduce=reduces(schedule, data_parallel, tied) if reduce is None else reduce,
        place_split=placed and source is None,
    )
    return _rebuilt(prepared, fitted, data_parallel, rebuild_within)


COST_FREE_POLICIES = (NO_TWO_BP, "eager")
"""The policies whose schedule does not depend on the costs: ``off`` runs it as
generated, ``eager`` puts each ``W`` right after its ``I``."""


@lru_cache(maxsize=512)
def _prepared_without_costs(
    name: str,
    n_ranks: int,
    n_microbatches: int,
    stages_per_rank: int | None,
    policy: str,
    microbatches_per_w: int | None,
    data_parallel: int,
    tied: bool,
    reduce: bool | None,
) -> tuple[Schedule, Schedule]:
    """The sourced and the prepared schedule of a policy of :data:`COST_FREE_POLICIES`.

    Kept between calls: a search builds the same schedule for every cost model
    it compares (the analytic planner's layouts share their ``p`` and ``m``).
    Schedules are frozen, so callers share them safely.
    """
    schedule = source_schedule(
        name, n_ranks=n_ranks, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
    )
    placed = policy != NO_TWO_BP
    prepared = finish_schedule(
        schedule,
        two_bp=placed or is_split(schedule),
        policy=policy if placed else "paper",
        costs=None,
        microbatches_per_w=microbatches_per_w if placed else None,
        reduce=reduces(schedule, data_parallel, tied) if reduce is None else reduce,
        place_split=placed,
    )
    return schedule, prepared


def _rebuilt(
    prepared: Schedule, fitted: CostModel, data_parallel: int, rebuild_within: float | None
) -> tuple[Schedule, CostModel]:
    """``prepared`` with its costs timed, and its stashes over ``rebuild_within`` rebuilt."""
    timed = timed_costs(prepared, fitted, data_parallel)
    if rebuild_within is not None:
        prepared = fewest_rebuilds(prepared, timed, rebuild_within)
    return prepared, timed


def simulate_candidate(
    name: str,
    policy: str,
    n_ranks: int,
    n_microbatches: int,
    costs: CostModel | CostsFor,
    *,
    stages_per_rank: int | None = None,
    microbatches_per_w: int | None = None,
    memory_limit: float | None = None,
    data_parallel: int = 1,
    tied: bool = False,
    rebuild_within: float | None = None,
    split: tuple[bool, ...] | None = None,
    source: Schedule | None = None,
    reduce: bool | None = None,
) -> tuple[Candidate, Schedule | None]:
    """Build one combination (:func:`build_schedule`) and simulate it.

    Each stage held by several ranks (``data_parallel`` copies, and the
    pipelines of the schedule) all-reduces its gradients at its ``R``.
    Contended costs are also simulated without contention
    (``uncontended_makespan``).

    Args:
        name, policy, n_ranks, n_microbatches, costs, stages_per_rank,
            microbatches_per_w, memory_limit, data_parallel, tied, rebuild_within,
            split, source, reduce: as for :func:`build_schedule`.

    Returns:
        The candidate (with ``error`` if it cannot be built or run; with the
        stages per rank it ran with) and its schedule (None on error): the
        schedule a pipeline with these options runs.
    """
    base = Candidate(
        name,
        policy,
        stages_per_rank=stages_per_rank,
        microbatches_per_w=microbatches_per_w,
        split=split,
    )
    try:
        schedule, fitted = build_schedule(
            name,
            n_ranks,
            n_microbatches,
            stages_per_rank,
            policy,
            costs,
            memory_limit=memory_limit,
            microbatches_per_w=microbatches_per_w,
            data_parallel=data_parallel,
            tied=tied,
            rebuild_within=rebuild_within,
            split=split,
            source=source,
            reduce=reduce,
        )
        candidate = _simulated(base, schedule, fitted)
    except (ValueError, DeadlockError) as exc:
        return replace(base, error=str(exc).splitlines()[0]), None
    return candidate, schedule


def simulate_prepared(
    schedule: Schedule,
    costs: CostModel | CostsFor,
    *,
    data_parallel: int = 1,
    rebuild_within: float | None = None,
) -> tuple[Candidate, Schedule]:
    """Simulate a schedule prepared already (a pipeline's own), as :func:`simulate_candidate`
    simulates one it builds: fitted, its reductions timed, its stashes over
    ``rebuild_within`` rebuilt.

    Returns:
        The candidate (named by the schedule) and the schedule simulated.

    Raises:
        ValueError: if the costs do not fit it, or
            :class:`twobp.sim.rebuild.RebuildError` if no rebuild fits ``rebuild_within``.
        DeadlockError: if it cannot run.
    """
    prepared, timed = _rebuilt(schedule, _fitted(costs, schedule), data_parallel, rebuild_within)
    policy = "prepared" if is_split(prepared) else NO_TWO_BP
    return _simulated(Candidate(prepared.name, policy), prepared, timed), prepared


def _simulated(base: Candidate, schedule: Schedule, fitted: CostModel) -> Candidate:
    """``base`` with the simulated step of ``schedule`` under ``fitted`` (and without
    contention, where ``fitted`` has some)."""
    result = simulate(schedule, fitted)
    alone = result if fitted.contention == 1 else simulate(schedule, uncontended(fitted))
    return replace(
        base,
        makespan=result.makespan,
        bubble_ratio=result.bubble_ratio,
        peak_memory=max(result.peak_memory),
        stages_per_rank=schedule.pipeline_stages // schedule.n_ranks,
        uncontended_makespan=alone.makespan,
        rebuilds=rebuild_count(schedule),
    )
