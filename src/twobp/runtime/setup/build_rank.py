"""The builder of one rank's parts: a planned pipeline, on this rank (see :mod:`.rank_parts`).

:func:`build_rank` turns a :class:`~twobp.runtime.setup.pipeline_plan.PipelinePlan`
into this rank's :class:`~twobp.runtime.setup.rank_parts.RankParts`: its stages on
its device, the reducer of replicated gradients, the model state, the links to
its peers and the step runner. It never plans: what runs is what the plan says.
The trial steps of ``schedule="auto"`` build one per contender
(:func:`contender_trials`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from twobp.partition import stage_ranges
from twobp.runtime.base.group import Membership
from twobp.runtime.base.topology import Topology
from twobp.runtime.communication.agreement import agree, small_buffer
from twobp.runtime.communication.links import make_links
from twobp.runtime.communication.reduction import GradientReducer
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.backward import stage_gradients
from twobp.runtime.execution.memory import MemoryMeter
from twobp.runtime.execution.stage import LossFn, Stage
from twobp.runtime.execution.step_runner import StepRunner
from twobp.runtime.options import Batch, PipelineOptions
from twobp.runtime.setup.auto.plan import Contender
from twobp.runtime.setup.auto.trials import run_trials, stand_in_loss
from twobp.runtime.setup.compile_trial import CompileTrial
from twobp.runtime.setup.compiled_stages import compile_options, compile_stage
from twobp.runtime.setup.data_parallel import make_reducer
from twobp.runtime.setup.pipeline_plan import PipelinePlan, Trials
from twobp.runtime.setup.rank_parts import RankParts
from twobp.runtime.setup.replicas import SharedParameter, local_aliases, shared_parameters
from twobp.runtime.setup.sharded_parameters import check_shardable, shard_parameters
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.runtime.state.model_names import ModelNames
from twobp.runtime.state.model_state import PipelineState
from twobp.runtime.state.optimizer_and_rng import parameter_names
from twobp.runtime.state.settlement import Settlement
from twobp.schedule.action import Kind
from twobp.schedule.lowering import add_communication, split_stages
from twobp.schedule.rebuild import rebuilt_microbatches
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import plan_communication
from twobp.sim.recompute import effective_modes, parse_recompute


def build_rank(
    plan: PipelinePlan,
    blocks: Sequence[nn.Module],
    loss_fn: LossFn,
    members: Membership,
    device: torch.device,
    options: PipelineOptions,
    grid: Sequence[Sequence[int]],
    *,
    names: ModelNames | None = None,
    compile: dict[str, Any] | None = None,
    grad_scaler: GradScaler | None = None,
) -> RankParts:
    """This rank's parts of the pipeline ``plan`` describes. Collective.

    Args:
        plan: the schedule and the blocks of every stage.
        blocks: the whole model's blocks (only this rank's are kept).
        loss_fn: the loss of the last stage.
        members: the group.
        device: where this rank computes.
        options: the pipeline's options (``nonfinite``, ``recompute``,
            ``weight_group_size``, ``autocast``).
        grid: the group ranks of every copy of the pipeline.
        names: the names of the model the blocks were cut from, or None.
        compile: ``torch.compile``'s options for the stages (None: eager).
        grad_scaler: the loss scaler, or None.

    Raises:
        PipelineConfigError: on every rank, if a rank could not build its
            stages (naming it), or the schedule lacks a reduction it needs.
    """
    schedule, ranges = plan.schedule, tuple(plan.ranges)
    topology = Topology.replicated(members, schedule, grid)
    recompute = _recompute_modes(options, schedule, members.rank)
    mine = sorted(
        {i for s in schedule.stages_of(topology.pp_rank) for i in ranges[schedule.model_stage(s)]}
    )
    module = nn.Sequential(OrderedDict((str(i), blocks[i]) for i in mine))
    shared = shared_parameters(blocks, ranges)
    aliases = local_aliases(shared, mine, blocks)
    memory = MemoryMeter(device)
    module, stages = _stages(
        plan, topology.pp_rank, module, loss_fn, options, recompute, memory, compile, members
    )
    for stage in stages.values():  # its errors name modules as the model does
        stage.model_name = None if names is None else names.name
    modules = {s: stage.module for s, stage in stages.items()}
    reducer = make_reducer(members, topology, schedule, modules, shared, options.timeout)
    _check_reductions_placed(reducer, schedule, topology.pp_rank, members.rank)
    state = _model_state(plan, module, members, topology, device, options, aliases, shared, names)
    state.grad_scaler = grad_scaler
    runner = _runner(members, topology, schedule, stages, reducer, options, grid, device)
    _shard_parameters(options, schedule, reducer, modules, state, runner)
    measured = compile is not None and compile.get("stages", "measured") == "measured"
    trial = CompileTrial(modules, f"rank {members.rank} ") if measured else None
    return RankParts(
        schedule=schedule,
        topology=topology,
        stage_blocks=ranges,
        recompute=recompute,
        module=module,
        stages=stages,
        state=state,
        lowered_schedule=add_communication(schedule),
        runner=runner,
        settlement=Settlement(
            module.parameters,
            lambda: state.sharded,
            members.rank,
            options.nonfinite,
            topology.dp_size,
        ),
        reducer=reducer,
        memory=memory,
        grad_scaler=grad_scaler,
        compile_trial=trial,
        _comm=plan_communication(schedule, topology.pp_rank),
        _start_buffer=small_buffer(members.size, device),
    )


def _shard_parameters(
    options: PipelineOptions,
    schedule: Schedule,
    reducer: GradientReducer | None,
    modules: dict[int, nn.Module],
    state: PipelineState,
    runner: StepRunner,
) -> None:
    """With ``shard_parameters=True``: shard this rank's parameters over their copies, and
    have each step gather and free them (see :mod:`twobp.runtime.setup.sharded_parameters`)."""
    if not options.shard_parameters:
        return
    topology = state.topology
    check_shardable(options, schedule, topology.dp_size, state.rank)
    sharded = shard_parameters(
        reducer,
        schedule,
        topology.pp_rank,
        modules,
        parameter_names(state.named_parameters()),
        state.rank,
        options.timeout,
    )
    sharded.scatter_each_w = options.scatter_each_w
    state.sharded = sharded
    runner.wait_parameters = sharded.wait
    runner.residency = sharded


def _model_state(
    plan: PipelinePlan,
    module: nn.Sequential,
    members: Membership,
    topology: Topology,
    device: torch.device,
    options: PipelineOptions,
    aliases: dict[str, tuple[str, ...]],
    shared: dict[int, SharedParameter],
    names: ModelNames | None,
) -> PipelineState:
    """This rank's blocks as a model (parameters, state dicts, checkpoints)."""
    schedule, ranges = plan.schedule, tuple(plan.ranges)
    return PipelineState(
        module=module,
        rank=members.rank,
        pp_rank=topology.pp_rank,
        topology=topology,
        device=device,
        timeout=options.timeout,
        schedule=schedule,
        stage_blocks=ranges,
        aliases=aliases,
        written_blocks=frozenset(
            i for s in topology.written_stages for i in ranges[schedule.model_stage(s)]
        ),
        tied_names={n: tie.name for tie in shared.values() for n in tie.names[1:]},
        model_names=names,
    )


def _recompute_modes(
    options: PipelineOptions, schedule: Schedule, rank: int
) -> tuple[str | None, ...]:
    """The recompute mode of every stage of ``schedule`` (under ``"auto"`` the schedule
    says which stashes are rebuilt, IR and WR: no mode)."""
    try:
        mode = None if options.rebuilds else options.recompute
        per_model_stage = parse_recompute(mode, schedule.pipeline_stages)
    except ValueError as error:
        raise PipelineConfigError(f"rank {rank}: {error}") from None
    return tuple(per_model_stage[schedule.model_stage(s)] for s in range(schedule.n_stages))


def _stages(
    plan: PipelinePlan,
    pp_rank: int,
    module: nn.Sequential,
    loss_fn: LossFn,
    options: PipelineOptions,
    recompute: tuple[str | None, ...],
    memory: MemoryMeter,
    compile: dict[str, Any] | None,
    members: Membership,
) -> tuple[nn.Sequential, dict[int, Stage]]:
    """This rank's blocks on its device, and its stages over them; a rank that fails
    here tells the others, instead of leaving them at the first step. Collective."""
    schedule, ranges = plan.schedule, plan.ranges
    split = split_stages(schedule)
    modes = effective_modes(recompute, split)
    rebuilt = rebuilt_microbatches(schedule)
    autocast = options.autocast
    stages: dict[int, Stage] = {}
    problem: Exception | None = None
    try:
        module = module.to(memory.device)
        for s in schedule.stages_of(pp_rank):
            model_stage = schedule.model_stage(s)
            stage_module = nn.Sequential(
                OrderedDict((str(i), getattr(module, str(i))) for i in ranges[model_stage])
            )
            if compile is not None:
                compile_stage(stage_module, compile, split=s in split)
            label = f"rank {members.rank} stage {s}"
            stages[s] = Stage(
                s,
                schedule.pipeline_stages,
                stage_module,
                stage_gradients(stage_module, split=s in split, label=label),
                loss_fn,
                schedule.n_microbatches,
                autocast=None if autocast is None else (memory.device.type, autocast),
                model_stage=model_stage,
                recompute=modes[s],
                memory=memory,
                label=label,
                rebuilt=rebuilt.get(s, ()),
            )
    except Exception as exc:
        problem = exc
    agree(members, memory.device, options.timeout, problem, "building the stages")
    return module, stages


def _runner(
    members: Membership,
    topology: Topology,
    schedule: Schedule,
    stages: dict[int, Stage],
    reducer: GradientReducer | None,
    options: PipelineOptions,
    grid: Sequence[Sequence[int]],
    device: torch.device,
) -> StepRunner:
    """The step runner of this rank, with the links to its peers: every rank makes and
    warms them up here, in one order. Collective."""
    links = (
        make_links(members, schedule, grid, options.timeout, device)
        if not members.is_single
        else None
    )
    return StepRunner(
        rank=members.rank,
        pp_rank=topology.pp_rank,
        device=device,
        timeout=options.timeout,
        topology=topology,
        n_microbatches=schedule.n_microbatches,
        stages=stages,
        reducer=reducer,
        weight_group_size=options.weight_group_size,
        links=links,
        order_only=options.order_only_matching,
        reduce_after_transfers=options.reduce_after_transfers,
    )


def _check_reductions_placed(
    reducer: GradientReducer | None, schedule: Schedule, pp_rank: int, rank: int
) -> None:
    """Every stage that reduces gradients here has its ``R`` in the schedule.

    The preparation pass places them (:func:`twobp.schedule.prepare.reduces`);
    a stage whose ``R`` were missing would never start its all-reduce.

    Raises:
        PipelineConfigError: naming the stages, if a given schedule lacks them.
    """
    if reducer is None:
        return
    placed = {a.stage for a in schedule.actions[pp_rank] if a.kind is Kind.REDUCE}
    missing = sorted(set(reducer.stages) - placed)
    if missing:
        raise PipelineConfigError(
            f"rank {rank}: stages {missing} hold gradients reduced over several "
            f"ranks, but the schedule {schedule.name or ''} has no R for them"
        )


def contender_trials(
    blocks: Sequence[nn.Module],
    options: PipelineOptions,
    example_input: Batch | None,
    members: Membership,
    device: torch.device,
    grid: Sequence[Sequence[int]],
    sample: Batch | None = None,
) -> Trials | None:
    """The trial steps of ``schedule="auto"``: each contender's :class:`RankParts`, built
    with ``options`` but the contender's prepared schedule and partition, stepping on the
    first step's batch ``sample`` or the example input repeated (None without either)."""
    if example_input is None and sample is None:
        return None
    trial = replace(
        options,
        # The contender is prepared: nothing is profiled, costed or bounded again
        # (what it rebuilds is in its schedule).
        costs=None,
        memory_limit=None,
        recompute=None if options.rebuilds else options.recompute,
        nonfinite="skip",
        auto_trials=0,
        # A trial's shards would make the blocks' parameters views of its own buffers.
        shard_parameters=False,
    )

    def build(contender: Contender) -> RankParts:
        plan = PipelinePlan(contender.schedule, tuple(stage_ranges(contender.partition)))
        # Trial steps take no optimizer step: the scaler stays with the pipeline.
        return build_rank(
            plan,
            blocks,
            stand_in_loss,
            members,
            device,
            trial,
            grid,
            compile=compile_options(trial.compile),
        )

    return partial(
        run_trials,
        build=build,
        blocks=blocks,
        example_input=example_input,
        batch=sample,
        world=members,
        device=device,
        timeout=options.timeout,
    )
