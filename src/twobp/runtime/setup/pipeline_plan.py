"""Decide, the same way on every rank, which schedule runs and which blocks each stage holds.

Every rank resolves the schedule and the partition from its own arguments.
Before any rank goes on, the ranks compare what they found
(:func:`twobp.runtime.setup.fingerprint.check_same_pipeline`): a configuration error on
any rank is raised on every rank, and ranks that were given other options or
built another model fail at once, naming the difference, instead of
deadlocking in the first step.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

import torch
from torch import nn

from twobp.partition import stage_ranges
from twobp.runtime.base.group import Membership
from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import batch_size, split_batch
from twobp.runtime.options import (
    AUTO,
    AUTO_MICROBATCHES,
    NONFINITE_POLICIES,
    PROFILE,
    Batch,
    CostsArgument,
    PipelineOptions,
)
from twobp.runtime.options import check_microbatches as check_microbatches
from twobp.runtime.setup.auto.cost_measurement import Measured, measure
from twobp.runtime.setup.auto.plan import (
    AutoPlan,
    OptimizerMemory,
    plan_auto,
    profiling_input,
    read_memory_limit,
)
from twobp.runtime.setup.fingerprint import check_same_pipeline, stable_hash
from twobp.runtime.setup.rebuild_choice import choose_rebuilds
from twobp.runtime.setup.stage_blocks import (
    balanced_counts,
    example_input_needed,
    stage_counts,
)
from twobp.runtime.setup.two_bp_choice import choose_two_bp
from twobp.schedule import SCHEDULES, Schedule, ScheduleConfigError, ScheduleError
from twobp.schedule._timing import Costs
from twobp.schedule.prepare import (
    DEFAULT_MICROBATCHES,
    TwoBP,
    prepare,
    reduces,
    source_schedule,
)
from twobp.schedule.two_bp import DYNAMIC
from twobp.sim.cost_io import load_costs
from twobp.sim.costs import CostModel
from twobp.sim.planner import NO_TWO_BP
from twobp.sim.rebuild_choice import RebuildChoice
from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_AUTO
from twobp.sim.search import microbatch_counts
from twobp.sim.split_choice import SplitChoice

Trials = Callable[[AutoPlan], AutoPlan]
"""Runs the trial steps of ``schedule="auto"``'s contenders and settles the plan
(:func:`twobp.runtime.setup.auto.trials.run_trials`, bound to the pipeline's arguments)."""

log = logging.getLogger("twobp")


@dataclass(frozen=True)
class PipelinePlan:
    """The schedule every rank runs and the blocks of every stage.

    Args:
        schedule: the compute schedule from the preparation pass
            (:func:`twobp.schedule.prepare.prepare`): 2BP placed, first-stage
            backwards fused, reductions placed, validated; under
            ``schedule="auto"``, the very schedule the search simulated.
        ranges: the block indices of every stage of the model (a schedule
            of several pipelines runs each model stage once per pipeline).
        auto: what ``schedule="auto"`` chose and from what; None for a given schedule.
        two_bp: with ``two_bp=None`` and an example input, the stages 2BP was
            found to pay on and the predictions (None otherwise).
        rebuilds: with ``recompute="auto"`` on a schedule by name, whether
            the schedule fit ``memory_limit`` as it was or which stashes are
            rebuilt, and the predictions (None otherwise).
        partition_by: how the blocks were cut into stages, in words
            (:func:`partition_reason`).
    """

    schedule: Schedule
    ranges: tuple[range, ...]
    auto: AutoPlan | None = None
    two_bp: SplitChoice | None = None
    rebuilds: RebuildChoice | None = None
    partition_by: str = "given"


def plan(
    blocks: Sequence[nn.Module],
    options: PipelineOptions,
    world: Membership,
    device: torch.device,
    sample: Batch | None = None,
    *,
    example_input: Batch | None = None,
    pipeline_ranks: Sequence[int] | None = None,
    trials: Trials | None = None,
    data_parallel: int = 1,
    tied: bool = False,
    decided: AutoPlan | None = None,
) -> PipelinePlan:
    """Resolve the schedule and the partition, and check that every rank agrees.

    Collective: every rank calls it. ``options`` and ``example_input`` are those of
    :class:`twobp.runtime.Pipeline`; ``pipeline_ranks`` are the group ranks of
    the first copy of the pipeline, by pipeline rank (None: the whole group);
    ``trials`` measures the contenders of ``schedule="auto"`` (rank 0's
    ``auto_trials`` of them; every rank needs it), None: the simulator's choice;
    ``data_parallel`` is the number of copies of the pipeline and ``tied`` says
    whether a weight is used by several blocks (both place reductions);
    ``sample`` is the first step's batch of inputs (the same on every rank)
    that ``schedule="auto"`` plans on where no ``example_input`` was given,
    and whose size ``n_microbatches="auto"`` chooses the count for;
    ``decided``: the plan of a range of tensor-parallel sizes, run as it is;
    ``recompute="auto"`` rebuilds stashes only where what the pipeline runs
    without it does not fit ``memory_limit``: a schedule by name is settled
    as without it (the same 2BP stages and partition), costed (profiled on
    ``example_input`` or the first micro-batch of ``sample``, or ``costs=``)
    and kept whole if it fits, else the fewest stashes that fit are rebuilt;
    under ``schedule="auto"`` (or ``costs="profile"``) every option the
    search simulates does the same.

    Returns:
        The layout, the same on every rank.

    Raises:
        PipelineConfigError: on every rank, if any rank's options do not fit
            (naming the rank and what to change).
        twobp.schedule.ScheduleError: on every rank, if the schedule is
            incomplete or deadlocks.
        ModelMismatchError: if ranks have other options or other models.
    """
    planning = _Planning(
        blocks, world, device, options, example_input, pipeline_ranks, data_parallel, tied, sample
    )
    schedule = options.schedule
    auto = _searched(planning, trials, decided) if decided or _searches(options) else None
    resolved, counts, rebuild = _resolved(planning, auto)
    # two_bp=None splits where a profile on the example input says it pays (else everywhere).
    profiled_split = (
        auto is None
        and options.two_bp is None
        and planning.example_input is not None
        and _named(schedule)
    )
    measured = None
    if rebuild is not None and rebuild[1] is None:
        # One profile for both choices: the stages 2BP pays on and the stashes to rebuild.
        measured = measure(
            blocks,
            world,
            device,
            _profiling_input(planning.example_input, sample, resolved.n_microbatches),
            resolved.n_microbatches,
            planning.ranks,
        )
    choice = _profiled_split(planning, counts, measured) if profiled_split else None
    if choice is not None:
        resolved = planning.prepared(choice.split)
    rebuilds = None
    if rebuild is not None:
        rebuilds, choice = _rebuilt(planning, resolved, counts, rebuild, measured, choice)
        resolved = rebuilds.schedule
    by = partition_reason(
        options.partition, planning.partition, auto, resolved, planning.example_input is not None
    )
    return PipelinePlan(resolved, tuple(stage_ranges(counts)), auto, choice, rebuilds, by)


@dataclass
class _Planning:
    """What :func:`plan` plans with; the example input, partition and count
    are what ``schedule="auto"`` chose, once it has."""

    blocks: Sequence[nn.Module]
    world: Membership
    device: torch.device
    options: PipelineOptions
    example_input: Batch | None
    pipeline_ranks: Sequence[int] | None
    data_parallel: int
    tied: bool
    sample: Batch | None
    partition: Sequence[int] | str | None = None
    n_microbatches: int | str | None = None

    def __post_init__(self) -> None:
        self.partition = self.options.partition
        self.n_microbatches = self.options.n_microbatches

    @property
    def ranks(self) -> list[int]:
        """The group ranks of the first copy of the pipeline, by pipeline rank."""
        if self.pipeline_ranks is None:
            return list(range(self.world.size))
        return list(self.pipeline_ranks)

    @property
    def optimizer(self) -> OptimizerMemory:
        options = self.options
        sharded = options.shard_parameters
        return OptimizerMemory(
            options.optimizer_state_bytes, options.optimizer_sharded or sharded, sharded
        )

    def prepared(self, split: TwoBP) -> Schedule:
        """The schedule by name, prepared with ``split`` as its 2BP."""
        assert not isinstance(self.n_microbatches, str)  # check_microbatches refused it
        options = self.options
        return prepare(
            options.schedule,
            n_ranks=len(self.ranks),
            n_microbatches=self.n_microbatches,
            two_bp=split,
            policy=options.two_bp_policy,
            stages_per_rank=options.stages_per_rank,
            costs=cost_model(options.costs),
            data_parallel=self.data_parallel,
            tied=self.tied,
        )


def searched_policies(policy: str, two_bp: object, fixed: bool) -> list[str] | None:
    """The 2BP policies a plan compares: the pipeline's own for a schedule by name; for
    ``schedule="auto"`` every one but ``dynamic`` (None), or, where the pipeline names
    ``dynamic``, ``dynamic`` and no 2BP (its W are placed at run time)."""
    if fixed:
        return [policy if two_bp is not False else NO_TWO_BP]
    return [NO_TWO_BP, DYNAMIC] if policy == DYNAMIC and two_bp is not False else None


def _searched(planning: _Planning, trials: Trials | None, decided: AutoPlan | None) -> AutoPlan:
    """What ``schedule="auto"`` (or ``costs="profile"`` on a schedule by name) chose,
    after the trial steps of its contenders (``decided``: what it chose over a range of
    tensor-parallel sizes). Collective."""
    if decided is not None:
        return _settled(planning, decided)
    options = planning.options
    schedule, two_bp = options.schedule, options.two_bp
    assert isinstance(schedule, str)
    fixed = schedule != AUTO
    if isinstance(two_bp, (list, tuple)):
        # The planned path searches policies for every stage alike.
        raise PipelineConfigError(
            f"two_bp={list(two_bp)!r} (one per stage) with costs={options.costs!r}, which plans "
            "2BP the same on every stage: pass True, False or None, or drop costs"
        )
    counts, examples = _microbatches(planning.n_microbatches, planning.sample, len(planning.ranks))
    if examples is not None:
        planning.example_input = next(iter(examples.values()))
    world = planning.world
    limit, model = auto_arguments(
        world,
        planning.device,
        options.timeout,
        options.memory_limit,
        options.costs,
        planning.example_input,
        options.auto_trials,
    )
    stages_per_rank = options.stages_per_rank
    auto = plan_auto(
        planning.blocks,
        world,
        planning.device,
        n_microbatches=counts,
        examples=examples,
        two_bp=two_bp is not False,
        stages_per_rank=(
            stages_per_rank or SCHEDULES[schedule].default_stages_per_rank
            if fixed
            else stages_per_rank
        ),
        partition=planning.partition,
        example_input=planning.example_input,
        memory_limit=limit,
        optimizer=planning.optimizer,
        costs=model,
        schedules=[schedule] if fixed else None,
        policies=searched_policies(options.two_bp_policy, two_bp, fixed),
        pipeline_ranks=planning.pipeline_ranks,
        tied=planning.tied,
        recompute=RECOMPUTE_AUTO if options.rebuilds else NO_RECOMPUTE,
        # Trial steps run on the example input: not with a cost model given.
        contenders=options.auto_trials if model is None and trials is not None and not fixed else 1,
    )
    if trials is not None and auto.contenders:
        auto = trials(auto)
    if world.rank == 0:
        log.info("%s", auto.summary())
    return _settled(planning, auto)


def _settled(planning: _Planning, auto: AutoPlan) -> AutoPlan:
    """``auto``, its partition and count taken as the pipeline's."""
    planning.partition = list(auto.partition)
    planning.n_microbatches = auto.schedule.n_microbatches
    return auto


def _resolved(
    planning: _Planning, auto: AutoPlan | None
) -> tuple[Schedule, list[int], tuple[float, CostModel | None] | None]:
    """The schedule (``auto``'s, or the one given prepared as asked), the blocks per
    stage, and with ``recompute="auto"`` on a schedule by name, the limit and the cost
    model (None: a profile) it rebuilds by; checked alike on every rank. Collective."""
    options = planning.options
    problem: Exception | None = None
    resolved: Schedule | None = None
    counts: list[int] | None = None
    rebuild: tuple[float, CostModel | None] | None = None
    example_input = balance_on = planning.example_input
    try:
        if auto is None and options.rebuilds:
            costs = _auto_costs(options.costs, "recompute='auto'")
            limit = read_memory_limit(options.memory_limit)
            assert limit is not None  # options.check() refused recompute='auto' without one
            rebuild = (limit, costs)
            if costs is None and example_input is None and planning.sample is None:
                raise PipelineConfigError(
                    "recompute='auto' costs the schedule on the blocks, profiled on "
                    "example_input=<one micro-batch of model inputs>: pass it (on every "
                    "rank), or a cost model as costs="
                )
        elif auto is None and options.memory_limit is not None:
            raise PipelineConfigError(
                f"memory_limit={options.memory_limit!r} bounds the choice of schedule='auto' "
                f"and what recompute='auto' rebuilds; with schedule={options.schedule!r} and "
                "neither it does nothing: drop it, or use schedule='auto' or recompute='auto'"
            )
        if options.nonfinite not in NONFINITE_POLICIES:
            raise PipelineConfigError(
                f"nonfinite={options.nonfinite!r}: use 'raise' (stop with NonFiniteLossError) "
                "or 'skip' (drop the step's gradients and go on)"
            )
        # What the search simulated is what runs: nothing prepares it again.
        two_bp = True if options.two_bp is None else options.two_bp
        resolved = auto.schedule if auto is not None else planning.prepared(two_bp)
        balance_on = example_input
        if balance_on is None and planning.sample is not None and resolved.ends_share_a_rank:
            # Planned at the first step to balance the stages: on its first micro-batch.
            balance_on = _profiling_input(None, planning.sample, resolved.n_microbatches)
        if planning.world.rank == 0:
            warn_unbalanced_ends(resolved, planning.partition, balance_on)
        planning.partition = default_partition(resolved, planning.partition, balance_on)
        counts = stage_counts(len(planning.blocks), resolved.pipeline_stages, planning.partition)
        if counts is None:
            example_input_needed(balance_on)
    except ScheduleConfigError as exc:
        problem = PipelineConfigError(str(exc))
    except (PipelineConfigError, ScheduleError) as exc:
        problem = exc
    agreed = {}
    if resolved is not None:
        agreed = _options(resolved, counts, planning.partition, options)
    agreed["2BP by a profile"] = str(
        auto is None
        and options.two_bp is None
        and example_input is not None
        and _named(options.schedule)
    )
    # Whether every rank joins the profile and the choice of recompute="auto".
    agreed["recompute='auto' costed on"] = (
        "-" if rebuild is None else "costs=" if rebuild[1] is not None else "a profile"
    )
    world, device = planning.world, planning.device
    check_same_pipeline(world, device, options.timeout, problem, agreed, planning.blocks)
    assert resolved is not None
    if counts is None:
        counts = balanced_counts(
            planning.blocks, resolved.pipeline_stages, balance_on, world, device
        )
    return resolved, counts, rebuild


def _profiled_split(
    planning: _Planning, counts: Sequence[int], measured: Measured | None
) -> SplitChoice:
    """The stages ``two_bp=None`` splits: where a profile says 2BP pays. Collective."""
    options = planning.options
    example_input = planning.example_input
    assert example_input is not None and not isinstance(planning.n_microbatches, str)
    sourced = source_schedule(
        options.schedule,
        n_ranks=len(planning.ranks),
        n_microbatches=planning.n_microbatches,
        stages_per_rank=options.stages_per_rank,
    )
    return choose_two_bp(
        planning.blocks,
        planning.world,
        planning.device,
        sourced,
        counts,
        example_input,
        policy=options.two_bp_policy,
        pipeline_ranks=planning.ranks,
        reduce=reduces(sourced, planning.data_parallel, planning.tied),
        data_parallel=planning.data_parallel,
        measured=measured,
    )


def _rebuilt(
    planning: _Planning,
    resolved: Schedule,
    counts: Sequence[int],
    rebuild: tuple[float, CostModel | None],
    measured: Measured | None,
    choice: SplitChoice | None,
) -> tuple[RebuildChoice, SplitChoice | None]:
    """What ``recompute="auto"`` runs: ``resolved`` if it fits, else the fewest stashes
    rebuilt, or fewer of ``choice``'s stages split; and the 2BP choice that then runs.
    Collective."""
    limit, costs = rebuild
    priced = costs if costs is not None else measured
    assert priced is not None
    # The stages two_bp=None chose to split, fewer of them: they hold fewer stashes.
    fewer = [] if choice is None else _fewer_split(choice.split)
    rebuilds = choose_rebuilds(
        planning.blocks,
        planning.world,
        resolved,
        counts,
        limit,
        costs=priced,
        optimizer=planning.optimizer,
        data_parallel=planning.data_parallel,
        fewer_split=(planning.prepared(split) for split in fewer),
    )
    if choice is not None and rebuilds.alternative is not None:
        split = fewer[rebuilds.alternative]
        choice = replace(choice, split=split, step=rebuilds.chosen_step)
    return rebuilds, choice


def _fewer_split(split: Sequence[bool]) -> list[tuple[bool, ...]]:
    """Every choice of split stages that splits some of ``split``'s, not all."""
    chosen = [s for s, b in enumerate(split) if b]
    return [
        tuple(s in kept for s in range(len(split)))
        for n in range(len(chosen))
        for kept in map(set, combinations(chosen, n))
    ]


def _profiling_input(example_input: Batch | None, sample: Batch | None, count: int) -> Batch:
    """What ``recompute="auto"`` profiles the blocks on: the example input, or the first
    micro-batch of the first step's batch."""
    if example_input is not None:
        return example_input
    assert sample is not None, "without an example input the pipeline plans at its first step"
    return split_batch(sample, count)[0]


def _named(schedule: object) -> bool:
    """True for a schedule given by name (not a ``Schedule`` or a CSV file)."""
    return isinstance(schedule, str) and schedule in SCHEDULES


def partition_reason(
    given: Sequence[int] | str | None,
    used: Sequence[int] | str | None,
    auto: AutoPlan | None,
    schedule: Schedule,
    example_given: bool = True,
) -> str:
    """Why the blocks were cut as they were, in a few words for the report
    (``example_given``: whether an example input was given to profile on)."""
    if auto is not None:
        return f"chosen by schedule={schedule.name.split(':')[0]!r}'s search"
    if given is not None:
        return "given" if not isinstance(given, str) else f"partition={given!r}"
    if used == "balanced" and not example_given:
        return (
            f"balanced on the first step's first micro-batch ({_ends(schedule)}; no example "
            "input was given)"
        )
    if used == "balanced":
        return f"balanced on the example input ({_ends(schedule)})"
    if schedule.ends_share_a_rank and schedule.n_ranks > 1:
        return "uniform: no example input to balance the stages on"
    return "uniform"


def _ends(schedule: Schedule) -> str:
    """Why ``schedule``'s stages are balanced: how it puts the model's ends on one rank."""
    how = "a V" if schedule.is_v_shaped else "two pipelines in opposite directions"
    return f"{how} puts the model's ends on one rank"


def warn_unbalanced_ends(schedule: Schedule, partition: object, example_input: object) -> None:
    """Warn once that a schedule whose ends share a rank (:attr:`Schedule.ends_share_a_rank`)
    runs the uniform partition for want of an example input."""
    if (
        schedule.ends_share_a_rank
        and schedule.n_ranks > 1
        and partition is None
        and example_input is None
    ):
        warnings.warn(
            f"{schedule.name.split(':')[0]} puts the model's first and last stages on rank 0; "
            "without example_input= its stages are cut uniformly, which loads that rank "
            "unlike the others when the ends (an embedding, a head) weigh unlike the layers: "
            "pass example_input=<one micro-batch of model inputs> to balance them, or a "
            "partition",
            UnbalancedPartitionWarning,
            stacklevel=2,
        )


class UnbalancedPartitionWarning(UserWarning):
    """A schedule whose ends share a rank (a V, Chimera or DualPipe on more than two ranks)
    runs the uniform partition (no example input to balance on)."""


def default_partition(
    schedule: Schedule, partition: Sequence[int] | str | None, example_input: Batch | None
) -> Sequence[int] | str | None:
    """The partition a pipeline cuts ``schedule``'s model by: ``partition`` if given;
    without one, ``"balanced"`` for a schedule that puts the model's first stage and
    its last on one rank (:attr:`Schedule.ends_share_a_rank`: a V, Chimera or DualPipe on
    more than two ranks) with an example input to profile on, and uniform (None)
    otherwise: a uniform partition loads that rank with both of the model's ends (an
    embedding, a head) against its neighbours' layers.
    """
    if partition is None and schedule.ends_share_a_rank and example_input is not None:
        return "balanced"
    return partition


def _microbatches(
    n_microbatches: int | str | None, sample: Batch | None, n_ranks: int
) -> tuple[int | list[int], dict[int, Batch] | None]:
    """The count (or the counts to choose among) ``schedule="auto"`` plans for, and,
    planning on the first step's batch, the first micro-batch of each count.

    Raises:
        PipelineConfigError: if the batch does not split into the count.
    """
    if n_microbatches == AUTO_MICROBATCHES:
        assert sample is not None, "n_microbatches='auto' plans on the first step's batch"
        size = batch_size(sample)
        counts: int | list[int] = microbatch_counts(size, n_ranks)
    else:
        counts = DEFAULT_MICROBATCHES if n_microbatches is None else int(n_microbatches)
    if sample is None:
        return counts, None
    every = [counts] if isinstance(counts, int) else counts
    return counts, {m: split_batch(sample, m)[0] for m in every}


def auto_arguments(
    world: Membership,
    device: torch.device,
    timeout: float,
    memory_limit: float | str | None,
    costs: CostsArgument,
    example_input: Batch | None,
    auto_trials: int,
) -> tuple[float | None, CostModel | None]:
    """The memory limit and the cost model ``schedule="auto"`` plans with, checked on
    every rank before any measures (collective).

    Raises:
        PipelineConfigError: on every rank, if any rank's limit, cost model,
            example input or count of trials does not do.
    """
    problem: PipelineConfigError | None = None
    limit = model = None
    try:
        if isinstance(auto_trials, bool) or not isinstance(auto_trials, int) or auto_trials < 0:
            raise PipelineConfigError(
                f"auto_trials={auto_trials!r}: give how many schedules schedule='auto' runs "
                "for a few trial steps before it settles (an int >= 0; 0 or 1: none, the "
                "simulator's choice)"
            )
        limit = read_memory_limit(memory_limit)
        model = None if costs == PROFILE else _auto_costs(costs, "schedule='auto'")
        if model is None:
            profiling_input(example_input)
    except PipelineConfigError as exc:
        problem = exc
    # The measurements are collectives without a timeout: no rank may enter them alone.
    agree(world, device, timeout, problem, "planning schedule='auto'")
    return limit, model


def _searches(options: PipelineOptions) -> bool:
    """True if ``schedule="auto"`` (or ``costs="profile"``) searches the schedule."""
    schedule = options.schedule
    return isinstance(schedule, str) and (schedule == AUTO or _profiles(schedule, options.costs))


def _profiles(schedule: str, costs: CostsArgument) -> bool:
    """True if ``costs="profile"`` asks to measure the costs of a schedule given by name."""
    return isinstance(costs, str) and costs == PROFILE and schedule in SCHEDULES


def _auto_costs(costs: CostsArgument, planned_by: str) -> CostModel | None:
    """The cost model ``schedule="auto"`` (or ``recompute="auto"``, as ``planned_by``
    says) plans with instead of profiling, if given.

    Raises:
        PipelineConfigError: for costs that are not a full cost model.
    """
    model = cost_model(costs)
    if model is None or isinstance(model, CostModel):
        return model
    raise PipelineConfigError(
        f"{planned_by} with costs= needs a twobp.sim.CostModel or a cost JSON file (it "
        "simulates memory and transfers too), not a mapping of times; or leave costs unset "
        "to profile the blocks"
    )


def cost_model(costs: CostsArgument) -> Costs:
    """The cost model of ``costs``: as given, or read from a cost JSON file.

    Raises:
        PipelineConfigError: if the file cannot be read as a cost model.
    """
    if not isinstance(costs, str | os.PathLike):
        return costs
    try:
        return load_costs(os.fspath(costs))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PipelineConfigError(
            f"costs={os.fspath(costs)!r} is not a readable cost model ({exc}); pass a cost "
            "JSON written by 'twobp profile' or 'twobp plan', or a twobp.sim.CostModel"
        ) from exc


AGREED_OPTIONS = (
    "two_bp_policy",
    "recompute",
    "autocast",
    "data_parallel",
    "order_only_matching",
    "reduce_after_transfers",
)
"""The options, besides the schedule they prepare, that change what a rank sends or
when it joins a collective: a rank with another value would wait for a message or a
reduction its neighbours never start."""


def _options(
    schedule: Schedule,
    counts: Sequence[int] | None,
    partition: Sequence[int] | str | None,
    options: PipelineOptions,
) -> dict[str, str]:
    """What must be the same on every rank, by name, short enough to show in an error."""
    return {
        "schedule": f"{schedule.name or 'custom'} (text #{stable_hash(str(schedule)) % 16**8:08x})",
        "stages": f"{schedule.n_stages} on ranks {list(schedule.placement)}"
        + (f" in {schedule.n_pipelines} pipelines" if schedule.n_pipelines > 1 else ""),
        "micro-batches": str(schedule.n_microbatches),
        "blocks per stage": str(list(counts) if counts is not None else partition),
        "nonfinite": options.nonfinite,
        **{name: repr(getattr(options, name)) for name in AGREED_OPTIONS},
    }
