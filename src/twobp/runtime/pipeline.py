"""The public pipeline: a model split into stages, run by a schedule over a group.

Every rank builds the whole model and passes its blocks; each rank keeps only
the blocks of its own stages. :meth:`Pipeline.step` runs one training step of
the schedule; afterwards the local parameters hold the same gradients as a
single-process backward of the mean loss over the batch.

Example (2 ranks, under ``torchrun --nproc-per-node 2`` or :func:`launch`)::

    pipe = Pipeline(blocks, F.mse_loss, schedule="1f1b", n_microbatches=4)
    optimizer = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(x, y)
    optimizer.step()
    pipe.zero_grad()
    pipe.save("checkpoints", optimizer, extra={"step": 1})  # pipe.load(...) resumes

A problem that one rank sees (a missing batch, a bad option) is raised on
every rank; see :mod:`twobp.runtime.execution.step_start` and
:mod:`twobp.runtime.setup.pipeline_plan`.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from twobp.engine.autocast import check_autocast_dtype
from twobp.runtime.base.group import (
    Membership,
    default_device,
    device_for,
    join_world,
    set_threads_per_rank,
)
from twobp.runtime.base.process_state import close_at_exit, forget
from twobp.runtime.base.topology import Topology
from twobp.runtime.communication import collective
from twobp.runtime.communication.agreement import agree, small_buffer
from twobp.runtime.communication.layout_cache import LayoutCache
from twobp.runtime.communication.links import make_links
from twobp.runtime.errors import (
    PipelineClosedError,
    PipelineConfigError,
    nonfinite_error,
)
from twobp.runtime.execution.backward import stage_gradients
from twobp.runtime.execution.memory import MemoryMeter, memory_stats
from twobp.runtime.execution.microbatch import (
    Batch,
    concat_microbatches,
    flatten,
    to_device,
    unflatten,
)
from twobp.runtime.execution.stage import LossFn, Stage
from twobp.runtime.execution.step_run import StepTimes
from twobp.runtime.execution.step_start import StepBatches, StepInputs, start_step
from twobp.runtime.options import (
    AUTO,
    AUTO_MICROBATCHES,
    CONTENDERS,
    CostsArgument,
    PipelineOptions,
)
from twobp.runtime.pipeline_steps import StepRunner
from twobp.runtime.setup.auto.plan import AutoPlan, Contender
from twobp.runtime.setup.auto.trials import run_trials, stand_in_loss
from twobp.runtime.setup.compile_trial import CompileTrial
from twobp.runtime.setup.compiled_stages import compile_options, compile_stage
from twobp.runtime.setup.data_parallel import data_parallel_grid, make_reducer
from twobp.runtime.setup.given_blocks import as_blocks
from twobp.runtime.setup.host_memory import retain_freed_memory
from twobp.runtime.setup.pipeline_plan import Trials, plan_pipeline
from twobp.runtime.setup.replicas import local_aliases, shared_parameters, tied_across_blocks
from twobp.runtime.state import checkpoint
from twobp.runtime.state.accumulation import EarlierGradients
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.runtime.state.model_names import ModelNames, model_names_of
from twobp.runtime.state.model_state import PipelineState
from twobp.runtime.state.optimizer_and_rng import parameter_names
from twobp.runtime.state.sharded_optimizer import ShardedParameters
from twobp.schedule import SCHEDULES
from twobp.schedule.action import Action, Kind
from twobp.schedule.lowering import add_communication, forward_only, is_split, split_stages
from twobp.schedule.rebuild import rebuilt_microbatches
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import CommPlan, plan_communication
from twobp.sim.rebuild_choice import RebuildChoice
from twobp.sim.recompute import effective_modes, parse_recompute
from twobp.sim.split_choice import SplitChoice
from twobp.timeline import Span

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def _same_doc(method: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give the decorated method the docstring of ``method`` (the state's method it calls)."""

    def document(delegate: _F) -> _F:
        delegate.__doc__ = method.__doc__
        return delegate

    return document


class Pipeline:
    """A model run as a pipeline of stages over the ranks of a process group.

    Args:
        blocks: the whole model as an ``nn.Sequential`` or a list of modules,
            built identically on every rank; for a model written as one
            ``nn.Module``, ``twobp.split(model)`` (then the pipeline uses the
            model's parameter names). Blocks pass a tensor or a tuple
            of tensors to the next; non-float tensors (masks, ids) get no
            gradient. Only this rank's blocks are kept: pass blocks you do not
            hold elsewhere, so the others are freed.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over one
            micro-batch; or ``-> (sum, count)`` for an exact mean over the whole
            batch when micro-batches count different numbers of items (padding).
        schedule: a name of :data:`twobp.schedule.SCHEDULES`, a ``Schedule``,
            the path of a CSV file, or ``"auto"``: profile the blocks on
            ``example_input`` (or plan on ``costs``), simulate every schedule,
            2BP policy, W group cap and stages per rank, and run the fastest
            that fits ``memory_limit`` (see :attr:`plan`).
        n_microbatches: micro-batches per step; None takes a Schedule's or
            CSV's own count, and 8 for a name; ``"auto"`` (with
            ``schedule="auto"``): chosen with the schedule for the first step's
            batch among ``p``, ``2p``, ``4p`` and ``8p`` (those that divide it;
            every count gives the same gradient), each profiled on its own
            micro-batch; later batches are cut into the same count.
        two_bp: True splits each backward into ``I`` and ``W`` (placing ``W`` by
            ``two_bp_policy``); False runs fused ``B`` (split schedules are merged);
            a list of one bool per stage of the model splits those given True
            only. None (the default): for a schedule by name given an
            ``example_input``, rank 0 profiles the blocks and the pipeline
            splits the stages where the simulator finds that 2BP makes the step
            faster (``pipe.two_bp_choice`` says which, and by how much);
            without an example input (or for a ``Schedule`` or CSV), True.
        partition: blocks per stage (one int per stage), ``"uniform"``, ``"balanced"``
            or None: uniform, but balanced (profiled on ``example_input``) for a
            V-shaped schedule (``zb-v``, ``dualpipev``) given an example input.
        two_bp_policy: ``"paper"``, ``"eager"`` or ``"fill"`` (see ``apply_two_bp``).
        stages_per_rank: stages per rank for a schedule name (None: its default).
        device: this rank's device; None picks ``cuda:LOCAL_RANK`` if CUDA is
            available and the backend can use it (NCCL), else the CPU.
        timeout: seconds a rank waits on a peer before raising ``PeerTimeoutError``.
        weight_group_size: passed to the engine's ``backward_weight`` for each ``W``.
        group: the process group to use; None uses the default group (initialised
            from ``torchrun``'s environment if needed), or a single process world.
        num_threads: intra-op threads of this rank; None shares the cores between
            the ranks of this machine unless ``OMP_NUM_THREADS`` is set.
        example_input: one micro-batch of model inputs, needed by
            ``partition="balanced"`` (rank 0 profiles the blocks on it).
        nonfinite: what :meth:`step` does when the mean loss is NaN or
            infinite: ``"raise"`` :class:`NonFiniteLossError`, or ``"skip"``
            the step (see :attr:`last_step_skipped`). Either way the step's
            gradients are dropped on every rank.
        autocast: run every stage's forward (and loss) under
            ``torch.autocast(device type, autocast)``, e.g. ``torch.bfloat16``:
            float32 master weights, the 2BP engine's I and W in autocast's dtypes.
            None: no autocast.
        data_parallel: run ``D`` copies of the pipeline on ``D x P`` ranks
            (copy ``d`` on ranks ``d * P .. d * P + P - 1``); each copy passes
            its own part of the global batch, ``n_microbatches`` counts the
            micro-batches of that part, and each stage's gradients are
            all-reduced over its copies by the schedule's ``R`` action, as
            soon as the stage's last ``W`` is done. None: 1, or the mesh's.
        mesh: a 2-D ``torch.distributed.device_mesh.DeviceMesh`` with dims
            ``("dp", "pp")`` that lays out the copies instead.
        costs: the cost model by which the ``paper`` and ``fill`` policies place
            ``W`` (a ``twobp.sim.CostModel``, a mapping ``{"F": t, "I": t,
            "W": t}``, or the path of a cost JSON as ``twobp profile`` writes
            it); with the same costs the placement is the one ``twobp plan``
            simulates. None: unit times. ``"profile"``: measure the blocks on
            ``example_input`` and place ``W`` by their costs, grouped where a
            concatenated ``W`` is cheaper (zero-bubble schedules too; see
            :attr:`plan`). With ``schedule="auto"``, a cost model to choose by
            instead of profiling.
        recompute: trade compute for memory (see :mod:`twobp.sim.recompute`):
            ``"activations"`` keeps only each stage's inputs from ``F`` until
            ``I`` (or ``B``) and runs the forward again there; ``"derivatives"``
            keeps only the inputs and output gradients from ``I`` until ``W``,
            whose stash ``W`` rebuilds by running the forward and input pass
            again; ``"all"`` both; or a list with one mode (or None) per
            stage of the model. Random states are replayed, so gradients are
            unchanged. ``"auto"`` (with ``memory_limit``): run what the
            pipeline runs without it (the same schedule, 2BP stages and
            partition) if the simulator predicts it fits the limit, on the
            profiled costs (or ``costs=``); else rebuild the fewest stashes
            that fit, chosen per stage and micro-batch (see
            :attr:`rebuild_choice`); the schedule shows which (``IR`` and ``WR``
            actions: :func:`twobp.schedule.rebuild.rebuilt_microbatches`), and
            with ``schedule="auto"`` the planner ranks it against every other
            schedule. None: keep everything.
        memory_limit: for ``schedule="auto"`` (or ``recompute="auto"``), the
            most bytes a rank may hold (parameters and their gradients,
            activations, stored W inputs as the simulator counts them), a
            number or a size such as ``"2GiB"``.
        optimizer_state_bytes: for ``schedule="auto"`` (or ``recompute="auto"``),
            the bytes of optimizer state each parameter adds, held all the
            time, counted against ``memory_limit`` (AdamW in float32: 8; with
            float32 masters of half-precision parameters: 12). 0: not counted.
        optimizer_sharded: for ``schedule="auto"`` (or ``recompute="auto"``),
            the optimizer will be :meth:`shard_optimizer`'s: each holder of a
            stage counts ``1/n`` of its optimizer state, ``R`` is timed as a
            reduce-scatter and the gather of the updated parameters as the
            runtime waits for it.
        retain_host_memory: on a CPU device, make the process keep the memory
            it frees for its next allocations instead of giving it back to the
            system after every step, where the next step's activations would
            fault their pages in again (glibc's malloc; see
            :mod:`twobp.runtime.setup.host_memory`). A setting of the whole
            process, like ``num_threads``; the resident memory stays at its
            peak. False leaves the allocator as it is.
        auto_trials: for ``schedule="auto"`` on measured costs, how many
            schedules run a few trial steps before the pipeline settles on
            the fastest measured: the simulator's choice and the fastest
            simulated candidate of each other schedule and stage count (see
            :mod:`twobp.runtime.setup.auto.trials`; the times show in
            :attr:`plan`). The simulator cannot tell apart schedules within a
            few per cent of each other; the trials can. 0 or 1: run the
            simulator's choice. Rank 0's count counts.
        compile: compile each block with ``torch.compile`` (in place: the
            parameter names stay). In a 2BP stage the graph is cut at the
            calls that read parameters, which defer their weight gradients as
            in eager mode, and the regions between are compiled (see
            :mod:`twobp.engine.compiled`). True: inductor; a dict:
            ``torch.compile``'s keywords (``backend``, ``mode``, ``dynamic``).
            Blocks the user compiled keep 2BP without it.
        order_only_matching: send every point-to-point operation with tag 0,
            so that gloo too matches them by order only, as NCCL does (also
            with ``TWOBP_ORDER_ONLY_MATCHING=1`` in the environment, read
            once, here; see docs/reliability.md).
        reduce_after_transfers: start the reductions of ``R`` only once the
            step's transfers are complete on any backend, as on NCCL (also
            with ``TWOBP_REDUCE_AFTER_TRANSFERS=1``, read once, here).
        grad_scaler: a :class:`twobp.GradScaler` for float16 (with
            ``autocast=torch.float16``): every micro-batch's loss is
            multiplied by its scale before its backward, so I and W see scaled
            gradients (:meth:`step` still returns the unscaled mean loss);
            ``scaler.unscale_``, ``step`` and ``update`` agree on overflows by
            one all-reduce over every rank of the pipeline and its copies, so
            all ranks skip or step together and the scale moves identically.
            An overflow is then a skipped step, not a ``NonFiniteLossError``
            (a loss that is not finite itself still follows ``nonfinite``).
            None: no loss scaling.

    Every argument after ``loss_fn`` is a field of
    :class:`twobp.runtime.options.PipelineOptions`, documented there too, and
    :attr:`options` holds them.

    Construction is collective: the ranks check that they resolved the same
    schedule and partition and built the same model (a fingerprint of every
    block's parameter names, shapes and dtypes; a sample of values only warns).

    Raises:
        PipelineConfigError: on every rank, if the schedule, partition, options
            or model do not fit on any rank, or the device cannot run ``autocast``.
        ModelMismatchError: if the ranks were given other options or built
            other models (it names the ranks and the first differing block).
        twobp.schedule.ScheduleError: if the schedule is incomplete or deadlocks.
    """

    def __init__(
        self,
        blocks: nn.Sequential | Sequence[nn.Module],
        loss_fn: LossFn,
        schedule: str | os.PathLike[str] | Schedule = "1f1b",
        n_microbatches: int | str | None = None,
        two_bp: bool | Sequence[bool] | None = None,
        partition: Sequence[int] | str | None = None,
        *,
        two_bp_policy: str = "paper",
        stages_per_rank: int | None = None,
        device: torch.device | str | None = None,
        timeout: float = 300.0,
        weight_group_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        num_threads: int | None = None,
        example_input: Batch | None = None,
        nonfinite: str = "raise",
        costs: CostsArgument = None,
        autocast: torch.dtype | None = None,
        data_parallel: int | None = None,
        mesh: Any = None,
        recompute: str | Sequence[str | None] | None = None,
        memory_limit: float | str | None = None,
        optimizer_state_bytes: float = 0.0,
        optimizer_sharded: bool = False,
        retain_host_memory: bool = True,
        auto_trials: int = CONTENDERS,
        compile: bool | dict[str, Any] = False,
        order_only_matching: bool = False,
        reduce_after_transfers: bool = False,
        grad_scaler: GradScaler | None = None,
        options: PipelineOptions | None = None,
    ) -> None:
        keywords = {k: v for k, v in locals().items() if k in _OPTION_NAMES}
        self._released = False
        all_blocks = as_blocks(blocks)
        names = model_names_of(blocks)
        self.options = (options or PipelineOptions()).updated(keywords)
        """What this pipeline was built with (:class:`twobp.runtime.options.PipelineOptions`):
        ``options``, with every keyword given that is not its default taken instead."""
        self.options.check()
        # The pipeline keeps neither the process group nor a mesh of groups alive (destroying
        # the group ends it, see close()): only planning, at the first step, sees them.
        given = _Given(self.options, example_input, group, mesh)
        timeout, num_threads = self.options.timeout, self.options.num_threads
        autocast, compile = self.options.autocast, self.options.compile
        data_parallel = self.options.data_parallel
        self._compile = compile_options(compile)
        self._compile_trial: CompileTrial | None = None
        _check_grad_scaler(grad_scaler, self)
        self.timeout = float(timeout)
        requested = torch.device(device) if device is not None else None
        members = join_world(requested or default_device(), self.timeout, group)
        self.device = requested if requested is not None else device_for(members)
        """The device this rank computes on."""
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = default_device()
            # Collectives of objects (timeline, balanced partition) use the current device.
            torch.cuda.set_device(self.device)
        self.rank = members.rank
        """This process's rank in the process group."""
        if autocast is not None:
            try:
                check_autocast_dtype(self.device, autocast)
            except ValueError as error:
                raise PipelineConfigError(
                    f"rank {self.rank}: autocast={autocast}: {error}"
                ) from None
        set_threads_per_rank(members.local_size, num_threads)
        if self.options.retain_host_memory and self.device.type == "cpu":
            retain_freed_memory()
        grid = data_parallel_grid(members, data_parallel, mesh)
        self.autocast = autocast
        """The dtype every stage's forward runs under ``torch.autocast`` with, or None."""
        self.plan: AutoPlan | None = None
        """What ``schedule="auto"`` (or ``costs="profile"``) chose: its candidate, the
        ranking, the predicted step time (``print`` shows it); None otherwise, and until
        the first step where ``auto`` plans on that step's inputs."""
        self.two_bp_choice: SplitChoice | None = None
        self.rebuild_choice: RebuildChoice | None = None
        self.grad_scaler = grad_scaler
        """The :class:`twobp.GradScaler` that scales this pipeline's losses, or None."""
        if grad_scaler is not None:
            grad_scaler.bind(self, members, self.device, self.timeout)
        self._pending: _Pending | None = None
        self._closed_unplanned = False
        # Known before planning, so that each copy can pass its own part of the first batch.
        self.dp_rank = next(d for d, row in enumerate(grid) if members.rank in row)
        self.dp_size = len(grid)
        if _plans_at_first_step(given, members, self.device, self.timeout):
            # Every block until the first step: an optimizer built on parameters() now
            # holds this rank's too (the others never get a gradient here).
            self._pending = _Pending(all_blocks, names, loss_fn, given, members, grid)
            close_at_exit(self)
            return
        self._build(all_blocks, names, loss_fn, given, members, grid, None)

    def _build(
        self,
        all_blocks: list[nn.Module],
        names: Any,
        loss_fn: LossFn,
        given: _Given,
        members: Membership,
        grid: list[list[int]],
        sample: Batch | None,
    ) -> None:
        """Plan the schedule (on ``sample``, the first step's inputs, if given) and build
        this rank's stages, its reducer and its step runner. Collective."""
        plan = plan_pipeline(
            all_blocks,
            members,
            self.device,
            given.options,
            example_input=given.example_input,
            pipeline_ranks=grid[0],
            trials=_trials(all_blocks, given, members, self.device, sample),
            data_parallel=len(grid),
            tied=tied_across_blocks(all_blocks),
            sample=sample,
        )
        self.plan = plan.auto
        self.two_bp_choice = plan.two_bp
        """With ``two_bp=None`` and an example input: which stages split their
        backward, with the predicted steps (:class:`twobp.sim.split_choice.SplitChoice`);
        None otherwise."""
        self.rebuild_choice = plan.rebuilds
        """With ``recompute="auto"`` on a schedule by name: whether the schedule fit
        ``memory_limit`` as it is or how many stashes are rebuilt, with the predicted
        peaks and steps (:class:`twobp.sim.rebuild_choice.RebuildChoice`); None otherwise."""
        self.schedule = plan.schedule
        """The compute schedule every pipeline rank runs (ranks of the schedule: pipeline ranks)."""
        self.topology = Topology.replicated(members, self.schedule, grid)
        """Which process runs each stage, and which hold its replicas."""
        self.pp_rank = self.topology.pp_rank
        """This process's pipeline rank: its row of the schedule."""
        self.dp_rank = self.topology.dp_rank
        """Which copy of the pipeline this process belongs to (0 without data parallel)."""
        self.dp_size = self.topology.dp_size
        """How many copies of the pipeline run side by side."""
        self.n_microbatches = self.schedule.n_microbatches
        self.nonfinite = given.options.nonfinite
        try:
            # Under "auto" the schedule says which stashes are rebuilt (IR and WR), no mode.
            mode = None if given.options.rebuilds else given.options.recompute
            per_model_stage = parse_recompute(mode, self.schedule.pipeline_stages)
            self.recompute = tuple(
                per_model_stage[self.schedule.model_stage(s)] for s in range(self.schedule.n_stages)
            )
            """The recompute mode of every stage (None: none); a list names one per model stage."""
        except ValueError as error:
            raise PipelineConfigError(f"rank {self.rank}: {error}") from None
        ranges = plan.ranges
        self.stage_blocks = ranges
        """The block indices of every stage (all stages, not only this rank's)."""
        self.module = nn.Sequential()
        """This rank's blocks, named by their index in the whole model."""
        self.stages: dict[int, Stage] = {}
        shared = shared_parameters(all_blocks, ranges)
        aliases = local_aliases(shared, self._local_blocks(), all_blocks)
        problem: Exception | None = None
        try:
            self._build_stages(all_blocks, loss_fn)
        except Exception as exc:
            problem = exc
        del all_blocks
        # A rank that fails here tells the others, instead of leaving them at the first step.
        agree(members, self.device, self.timeout, problem, "building the stages")
        self._reducer = make_reducer(
            members,
            self.topology,
            self.schedule,
            {s: stage.module for s, stage in self.stages.items()},
            shared,
            self.timeout,
        )
        self._check_reductions_placed()
        self.state = PipelineState(
            module=self.module,
            rank=self.rank,
            pp_rank=self.pp_rank,
            topology=self.topology,
            device=self.device,
            timeout=self.timeout,
            schedule=self.schedule,
            stage_blocks=ranges,
            aliases=aliases,
            written_blocks=frozenset(
                i
                for s in self.topology.written_stages
                for i in ranges[self.schedule.model_stage(s)]
            ),
            tied_names={n: tie.name for tie in shared.values() for n in tie.names[1:]},
            model_names=None if names is None else ModelNames(names),
            grad_scaler=self.grad_scaler,
        )
        """This rank's blocks as a model: parameters, state dicts, checkpoints
        (:class:`twobp.runtime.state.model_state.PipelineState`)."""
        self.lowered_schedule = add_communication(self.schedule)
        """The schedule with its transfers between ranks: what this pipeline runs."""
        self._plan = plan_communication(self.schedule, self.pp_rank)
        # Collective: every rank makes and warms up the links to its peers here, in one order.
        links = (
            make_links(members, self.schedule, grid, self.timeout, self.device)
            if not members.is_single
            else None
        )
        self._layouts = LayoutCache()
        self._eval_layouts = LayoutCache()
        self._forward_schedule: Schedule | None = None
        self._forward_plan: CommPlan | None = None
        self._steps = StepRunner(
            rank=self.rank,
            pp_rank=self.pp_rank,
            device=self.device,
            timeout=self.timeout,
            topology=self.topology,
            n_microbatches=self.n_microbatches,
            stages=self.stages,
            reducer=self._reducer,
            weight_group_size=given.options.weight_group_size,
            links=links,
            order_only=given.options.order_only_matching,
            reduce_after_transfers=given.options.reduce_after_transfers,
        )
        self._earlier_gradients = EarlierGradients()
        self._start_buffer = small_buffer(members.size, self.device)
        self.skipped_steps: list[int] = []
        """Indices of the steps skipped for a non-finite loss (``nonfinite="skip"``)."""
        self.last_step_skipped = False
        """True if the last step's loss was not finite and its gradients were dropped."""
        close_at_exit(self)

    def plan_on(self, inputs: Batch | None) -> None:
        """Plan now on this batch of inputs, as the first step does. Collective.

        A pipeline with ``schedule="auto"`` and no ``example_input`` (or with
        ``n_microbatches="auto"``) plans at its first :meth:`step` (or
        :meth:`eval_step`), on that step's batch: rank 0 profiles the blocks
        on its first micro-batch (the batch of every count it tries, with
        ``n_microbatches="auto"``), and trial steps run on the batch. Call
        this to plan before the first step, for example to :meth:`load` a
        checkpoint into the planned stages. Nothing happens once planned.

        Args:
            inputs: the batch of model inputs (only rank 0's counts; others may pass None).

        Raises:
            PipelineConfigError: on every rank, if rank 0 has no inputs or they do
                not split; and what planning raises.
        """
        pending = self._pending
        if pending is None:
            return
        sample: Any = None
        if pending.members.rank == 0:
            sample = (
                "rank 0 was given no inputs"
                if inputs is None
                else to_device(_detached(inputs), torch.device("cpu"))
            )
        sample = collective.all_gather_objects(pending.members, sample, self.timeout)[0]
        if isinstance(sample, str):
            raise PipelineConfigError(
                f"rank {self.rank}: schedule='auto' plans on the first step's batch of inputs, "
                f"but {sample}: pass the batch on rank 0, or give example_input= when building "
                "the pipeline"
            )
        self._build(
            pending.blocks,
            pending.names,
            pending.loss_fn,
            pending.given,
            pending.members,
            pending.grid,
            sample,
        )
        self._pending = None

    def __getattr__(self, name: str) -> Any:
        # Only for what a pipeline that plans at its first step does not have yet.
        if self.__dict__.get("_closed_unplanned"):
            raise PipelineClosedError(
                f"rank {self.__dict__.get('rank')}: this pipeline was closed; build a new "
                "Pipeline to go on"
            )
        if self.__dict__.get("_pending") is not None:
            raise PipelineConfigError(
                f"rank {self.__dict__.get('rank')}: this pipeline plans its schedule on the "
                "first step's batch (schedule='auto' without example_input, or "
                f"n_microbatches='auto') and has no {name} until then: run a step first, or "
                "call plan_on(inputs)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _local_blocks(self) -> list[int]:
        """The indices of this rank's blocks, in model order."""
        schedule, ranges = self.schedule, self.stage_blocks
        mine = schedule.stages_of(self.pp_rank)
        return sorted({i for s in mine for i in ranges[schedule.model_stage(s)]})

    def _build_stages(self, all_blocks: list[nn.Module], loss_fn: LossFn) -> None:
        """Keep this rank's blocks, on its device, as its stages."""
        schedule, ranges = self.schedule, self.stage_blocks
        self.module = nn.Sequential(
            OrderedDict((str(i), all_blocks[i]) for i in self._local_blocks())
        ).to(self.device)
        split = split_stages(schedule)
        self._memory = MemoryMeter(self.device)
        modes = effective_modes(self.recompute, split)
        rebuilt = rebuilt_microbatches(schedule)
        for s in schedule.stages_of(self.pp_rank):
            model_stage = schedule.model_stage(s)
            module = nn.Sequential(
                OrderedDict((str(i), getattr(self.module, str(i))) for i in ranges[model_stage])
            )
            if self._compile is not None:
                compile_stage(module, self._compile, split=s in split)
            self.stages[s] = Stage(
                s,
                schedule.pipeline_stages,
                module,
                stage_gradients(module, split=s in split, label=f"rank {self.rank} stage {s}"),
                loss_fn,
                self.n_microbatches,
                autocast=None if self.autocast is None else (self.device.type, self.autocast),
                model_stage=model_stage,
                recompute=modes[s],
                memory=self._memory,
                label=f"rank {self.rank} stage {s}",
                rebuilt=rebuilt.get(s, ()),
            )
        if self._compile is not None and self._compile.get("stages", "measured") == "measured":
            self._compile_trial = CompileTrial(
                {s: stage.module for s, stage in self.stages.items()}, f"rank {self.rank} "
            )

    def _check_reductions_placed(self) -> None:
        """Every stage that reduces gradients here has its ``R`` in the schedule.

        The preparation pass places them (:func:`twobp.schedule.prepare.reduces`);
        a stage whose ``R`` were missing would never start its all-reduce.

        Raises:
            PipelineConfigError: naming the stages, if a given schedule lacks them.
        """
        if self._reducer is None:
            return
        placed = {a.stage for a in self.schedule.actions[self.pp_rank] if a.kind is Kind.REDUCE}
        missing = sorted(set(self._reducer.stages) - placed)
        if missing:
            raise PipelineConfigError(
                f"rank {self.rank}: stages {missing} hold gradients reduced over several "
                f"ranks, but the schedule {self.schedule.name or ''} has no R for them"
            )

    # -- the model state (this rank's blocks as a model; see PipelineState) -----------

    @property
    def step_count(self) -> int:
        """Steps run so far (restored by :meth:`load`); the index of the next step."""
        return self.state.step_count

    @property
    def background_saves(self) -> checkpoint.BackgroundSaves:
        """The checkpoint being written in the background (``save(..., async_save=True)``)."""
        return self.state.background_saves

    @property
    def written_blocks(self) -> frozenset[int]:
        """The blocks whose entries this process writes to a checkpoint (one copy each)."""
        return self.state.written_blocks

    @_same_doc(PipelineState.parameters)
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        if self._pending is not None:  # every block's until the first step plans
            return self._pending.model.parameters(recurse)
        return self.state.parameters(recurse)

    @_same_doc(PipelineState.named_parameters)
    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        if self._pending is not None:
            return self._pending.named(self._pending.model.named_parameters(), prefix)
        return self.state.named_parameters(prefix)

    @_same_doc(PipelineState.named_buffers)
    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        if self._pending is not None:
            return self._pending.named(self._pending.model.named_buffers(), prefix)
        return self.state.named_buffers(prefix)

    @_same_doc(PipelineState.state_dict)
    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    @_same_doc(PipelineState.load_state_dict)
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        return self.state.load_state_dict(state_dict, strict)

    @_same_doc(PipelineState.save)
    def save(
        self,
        path: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
        *,
        step: int | None = None,
        meta: Mapping[str, Any] | None = None,
        keep: int = 1,
        async_save: bool = False,
    ) -> Path:
        return self.state.save(
            path, optimizer, extra, step=step, meta=meta, keep=keep, async_save=async_save
        )

    @_same_doc(PipelineState.wait_for_checkpoint)
    def wait_for_checkpoint(self) -> Path | None:
        return self.state.wait_for_checkpoint()

    @_same_doc(PipelineState.load)
    def load(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        return self.state.load(path, optimizer)

    def train(self, mode: bool = True) -> Pipeline:
        """Set training mode of the local blocks (dropout, batch norm); returns the pipeline."""
        self.state.train(mode)
        return self

    def eval(self) -> Pipeline:
        """Set evaluation mode of the local blocks (what :meth:`eval_step` runs in is the
        blocks' mode: call ``eval()`` before evaluating, ``train()`` after); returns the
        pipeline."""
        return self.train(False)

    @_same_doc(PipelineState.zero_grad)
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending is not None:
            for block in self._pending.blocks:
                block.zero_grad(set_to_none=set_to_none)
            return
        self.state.zero_grad(set_to_none)

    @_same_doc(PipelineState.clip_grad_norm_)
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.state.clip_grad_norm_(max_norm, norm_type)

    # -- end of life -----------------------------------------------------------------

    def close(self) -> None:
        """End this pipeline: drop what it holds of communication and of unfinished steps.

        Every step completes its own transfers, so between steps nothing is in
        flight; after a step that failed part-way, the transfers it posted are
        abandoned here, and the weight-gradient work it left is dropped. The
        parameters and their gradients stay as they are, and the blocks are
        released: another pipeline may be built on them. Later calls of
        ``step``, ``eval_step``, ``timeline``, ``save``, ``load`` and
        ``clip_grad_norm_`` raise :class:`PipelineClosedError`. Idempotent;
        the runtime closes every pipeline still open when the interpreter exits.
        Not collective.
        """
        if self._pending is not None or self._closed_unplanned:
            self._pending, self._closed_unplanned = None, True
            forget(self)
            return
        if self.state.closed:
            return
        self.state.closed = True
        forget(self)
        scaler = getattr(self, "grad_scaler", None)
        if scaler is not None:
            scaler.unbind(self)
        for stage in self.stages.values():
            stage.abandon_step()
            # The blocks are free again: another pipeline may be built on them.
            stage.gradients.restore()
        self._steps.abandon_reductions()
        if self.state.sharded is not None:
            self.state.sharded.abandon()
        self._layouts.clear()
        self._eval_layouts.clear()
        self._forward_plan = None

    def release_blocks(self) -> None:
        """Let another pipeline on the same blocks run its steps until :meth:`claim_blocks`.

        The 2BP engine defers a module for one pipeline at a time: a second
        pipeline on the same blocks is refused while the first holds them. To
        compare two schedules on one model step by step, build the first,
        release it, build the second, and have each claim the blocks for its
        steps. Not collective; between steps only. :meth:`step` refuses to run
        until the blocks are claimed again.
        """
        self.state.check_open()
        for stage in self.stages.values():
            stage.gradients.release()
        self._released = True

    def claim_blocks(self) -> None:
        """Hold the blocks again after :meth:`release_blocks`.

        Raises:
            twobp.engine.TwoStageBackwardError: if another open pipeline holds them.
        """
        self.state.check_open()
        claimed: list[Stage] = []
        try:
            for stage in self.stages.values():
                stage.gradients.claim()
                claimed.append(stage)
        except Exception:
            for stage in claimed:
                stage.gradients.release()
            raise
        self._released = False

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- training and evaluation ---------------------------------------------------

    @property
    def needs_inputs(self) -> bool:
        """True if this rank runs a first stage of the model and needs the batch of inputs
        (under Chimera, the ranks of both pipelines' first stages)."""
        return any(self.schedule.model_stage(s) == 0 for s in self.stages)

    @property
    def needs_targets(self) -> bool:
        """True if this rank runs a last stage of the model and needs the batch of targets."""
        last = self.schedule.pipeline_stages - 1
        return any(self.schedule.model_stage(s) == last for s in self.stages)

    def step(self, inputs: Batch | None, targets: Batch | None) -> float:
        """Run one training step: forward and backward of every micro-batch.

        The step's gradients are added to ``.grad`` of this rank's parameters,
        so that steps without :meth:`zero_grad` between them accumulate exactly
        as ``backward`` does in plain PyTorch, replicated and tied parameters
        included: each step reduces only its own part. While a step runs, the
        gradients of earlier steps are held aside beside the step's own
        (memory: one more set of gradients while accumulating; more
        micro-batches per step accumulate at no memory cost). Collective:
        every rank calls it.

        Args:
            inputs: the batch of model inputs; only the rank of stage 0 needs it
                (others may pass None).
            targets: the batch of targets; only the rank of the last stage
                needs it (others may pass None).

        The batch may have any size (at least ``n_microbatches`` rows) and
        other shapes than the last step's: it splits as ``torch.tensor_split``
        does, and each micro-batch's loss is weighted by its share of the rows.

        Returns:
            The mean loss over the batch (the micro-batch losses weighted by
            their rows; for a loss returning ``(sum, count)``, the sum over
            the batch by the count over the batch), on every rank, unscaled
            under a ``grad_scaler``. NaN or infinite only with
            ``nonfinite="skip"``, when the step was skipped.

        Raises:
            PipelineConfigError: on every rank, if a needed batch is missing or
                holds fewer rows than micro-batches on any rank, the inputs and targets disagree on
                the batch size, or the ranks are not at the same step.
            NonFiniteLossError: on every rank, if the mean loss is not finite
                (with ``nonfinite="raise"``); the step's gradients were dropped,
                the earlier steps' are kept (so with ``nonfinite="skip"``).
            ShapeMismatchError: if a block's output shape depends on the values of
                its inputs, not only on their shapes (named by its boundary).
            PeerStepFailedError: on every other rank, when the step failed on
                one rank (in a block, the loss, a shape check); that rank raises
                its own error. The step's gradients are dropped on every rank (the
                earlier steps' are kept) and the pipeline can run the next step.
            PeerError: if a peer is gone or times out; then end the process
                (``torchrun`` can restart the group, and a checkpoint resumes the run).
        """
        if self._pending is not None:
            self.plan_on(inputs)
        self.state.check_open()
        if self._released:
            raise PipelineConfigError(
                f"rank {self.rank}: this pipeline released its blocks (release_blocks()); "
                "call claim_blocks() before its next step"
            )
        batches = self._prepare(inputs, targets, training=True)
        scale = 1.0 if self.grad_scaler is None else self.grad_scaler.loss_scale()
        for stage in self.stages.values():
            stage.set_loss_scale(scale)
        # The step reduces and settles its own gradients only (see accumulation).
        self._earlier_gradients.set_aside(self.module.parameters())
        if self._compile_trial is not None:
            self._compile_trial.before_step()
        try:
            _, end = self._steps.run_step(self.lowered_schedule, self._plan, batches, True)
        except BaseException:
            self._earlier_gradients.put_back()
            if self.state.sharded is not None:
                self.state.sharded.discard()
            self._layouts.forget(batches.code)
            raise
        loss, first_bad, bad_rank = end.loss, end.first_bad, end.bad_rank
        assert loss is not None
        if self._compile_trial is not None:
            self._compile_trial.after_step(self._steps.spans)
        if end.count is not None and math.isfinite(loss):
            self._divide_gradients(end.count / self.topology.dp_size)
        step = self.state.step_count
        self.state.step_count += 1
        self.last_step_skipped = not math.isfinite(loss)
        if self.last_step_skipped:
            # Every rank learnt the loss from the last stage: all drop the step alike.
            self._earlier_gradients.put_back()
            if self.state.sharded is not None:
                self.state.sharded.discard()
            if self.nonfinite == "raise":
                raise nonfinite_error(self.rank, step, loss, first_bad, bad_rank)
            self.skipped_steps.append(step)
        else:
            self._earlier_gradients.add_back()
            if self.state.sharded is not None:
                self.state.sharded.commit()
        return loss

    def shard_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **optimizer_kwargs: Any
    ) -> torch.optim.Optimizer:
        """An optimizer whose state is sharded over the ranks that hold each parameter (ZeRO-1).

        Each bucket of replicated parameters (the copies of a stage under
        ``data_parallel``, Chimera's and DualPipe's two pipelines, a weight
        tied across ranks) becomes a padded flat buffer cut into one
        contiguous shard per holder, laid out alike on every holder, bucket
        after bucket in the order of the stages' ``R`` on this rank. At each
        stage's ``R`` the gradients are reduce-scattered instead of
        all-reduced; ``optimizer.step()`` steps this rank's shards only (a
        float32 master shard for half-precision parameters); then the
        updated shards are all-gathered in the background, and each stage's
        next forward waits for its own (see
        :mod:`twobp.runtime.state.sharded_optimizer`). Parameters that no other
        rank holds are stepped whole. :meth:`clip_grad_norm_`,
        :meth:`zero_grad`, :meth:`memory_stats`, :meth:`save` and
        :meth:`load` know the shards. Every rank calls it, between steps.

        Args:
            optimizer_class: a ``torch.optim.Optimizer`` class (``torch.optim.AdamW``).
            **optimizer_kwargs: its arguments besides the parameters (``lr=...``).

        Returns:
            ``optimizer_class(shards, **optimizer_kwargs)``: a plain optimizer
            over this rank's shards (its ``param_groups`` drive LR schedulers;
            ``state_dict`` numbers the shards, ``pipe.save(path, optimizer)``
            saves the state by parameter name).

        Raises:
            PipelineConfigError: if no parameter of this pipeline is held by
                several ranks, the pipeline already has a sharded optimizer,
                ``optimizer_class`` is not an optimizer class, or
                ``optimizer_kwargs`` name ``params`` (the returned optimizer's
                ``add_param_group`` raises it too: one param group only).
        """
        self.state.check_open()
        is_class = isinstance(optimizer_class, type)
        if not (is_class and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise PipelineConfigError(
                f"shard_optimizer({optimizer_class!r}): pass an optimizer class such as "
                "torch.optim.AdamW, and its arguments as keywords"
            )
        if "params" in optimizer_kwargs:
            raise PipelineConfigError(
                f"rank {self.rank}: shard_optimizer makes the optimizer's parameters itself (this "
                "rank's shards, in one param group); pass only its options (lr=..., "
                "weight_decay=...). Param groups with other options per parameter are not "
                "supported on a sharded optimizer: use one setting for all, or a plain "
                "optimizer over pipe.parameters() with your groups"
            )
        if self.state.sharded is not None:
            raise PipelineConfigError(
                f"rank {self.rank}: this pipeline already has a sharded optimizer; keep the "
                "one shard_optimizer returned (its state_dict and pipe.load restore it)"
            )
        reducer = self._reducer
        if reducer is None or not any(b.parameters for bs in reducer.by_stage.values() for b in bs):
            raise PipelineConfigError(
                f"rank {self.rank}: shard_optimizer needs parameters held by several ranks "
                "(data_parallel > 1, chimera, dualpipe, or a weight tied across ranks); this "
                "pipeline holds each parameter on one rank: use "
                "optimizer_class(pipe.parameters(), ...) instead"
            )
        order = [a.stage for a in self.schedule.actions[self.pp_rank] if a.kind is Kind.REDUCE]
        order += [s for s in self.stages if s not in order]
        self.state.settle_parameters()
        sharded = ShardedParameters(
            reducer,
            order,
            {s: stage.module for s, stage in self.stages.items()},
            parameter_names(self.named_parameters()),
            self.rank,
            self.timeout,
            [a.stage for a in self.schedule.actions[self.pp_rank] if a.kind is Kind.FORWARD],
        )
        optimizer = optimizer_class(sharded.optimizer_parameters(), **optimizer_kwargs)
        sharded.attach(optimizer)
        sharded.route(reducer)
        self.state.sharded = sharded
        self._steps.wait_parameters = sharded.wait
        return optimizer

    @torch.no_grad()
    def eval_step(self, inputs: Batch | None, targets: Batch | None = None) -> Any:
        """Forward only, without autograd. Collective: every rank calls it.

        It runs in the mode the blocks are in, as a module's forward does:
        after training that is training mode (dropout on, BatchNorm on the
        batch's statistics). For a held-out loss call :meth:`eval` first and
        :meth:`train` after, as with an ``nn.Module``.

        Args:
            inputs: the batch (needed on the rank of stage 0).
            targets: the targets (needed on the rank of the last stage); None for outputs.

        Returns:
            With targets: the mean loss, on every rank. Without: on the rank of
            the last stage, the output batch (micro-batch outputs concatenated;
            under Chimera, the rank of the down pipeline's last stage, which
            gathers the up pipeline's outputs); None on the other ranks. Each
            data-parallel copy returns the outputs of its own batch.
        """
        if self._pending is not None:
            self.plan_on(inputs)
        self.state.check_open()
        if self._forward_plan is None:
            forward = forward_only(self.schedule)
            self._forward_schedule = add_communication(forward)
            self._forward_plan = plan_communication(forward, self.pp_rank)
        assert self._forward_schedule is not None
        # Layouts of their own: no gradient flags, and other shapes than training's.
        batches = self._prepare(inputs, targets, training=False)
        try:
            result, end = self._steps.run_step(
                self._forward_schedule, self._forward_plan, batches, False
            )
        except BaseException:
            self._eval_layouts.forget(batches.code)
            raise
        if end.loss is not None:
            return end.loss
        outputs = result.outputs
        if self.schedule.n_pipelines > 1:
            outputs = self._gather_outputs(outputs)
        if not outputs:
            return None
        parts = [unflatten(*outputs[m]) for m in range(self.n_microbatches)]
        return concat_microbatches(parts)

    def _gather_outputs(self, outputs: dict[int, Any]) -> dict[int, Any]:
        """Every pipeline's outputs of this copy, on the rank of the first pipeline's last
        stage (empty elsewhere). Collective."""
        mine = {m: (tuple(t.cpu() for t in ts), is_tuple) for m, (ts, is_tuple) in outputs.items()}
        every = collective.all_gather_objects(self.topology.members, mine)
        if self.rank != self.topology.rank_of_stage(self.schedule.pipeline_stages - 1):
            return {}
        gathered: dict[int, Any] = {}
        for rank in self.topology.pipeline_ranks:
            for m, (ts, is_tuple) in every[rank].items():
                gathered[m] = (tuple(t.to(self.device) for t in ts), is_tuple)
        return gathered

    def _prepare(self, inputs: Batch | None, targets: Batch | None, training: bool) -> StepBatches:
        schedule = self.schedule
        last = schedule.pipeline_stages - 1
        return start_step(
            self.topology,
            self.device,
            self.timeout,
            StepInputs(inputs, targets, training, self.step_count),
            self.n_microbatches,
            self._layouts if training else self._eval_layouts,
            self._start_buffer,
            (schedule.replicas_of(0), schedule.replicas_of(last)),
        )

    @torch.no_grad()
    def _divide_gradients(self, divisor: float) -> None:
        """Divide the step's own gradients (earlier steps' are set aside) by ``divisor``:
        a loss that returned ``(sum, count)`` is the mean over the count of the whole batch.

        They live in the parameters' ``grad``, and under a sharded optimizer, for the
        replicated parameters, in the step's reduced shards (their ``grad`` was dropped
        at ``R``), which the step commits after this."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
        if self.state.sharded is not None:
            self.state.sharded.divide_pending(divisor)

    # -- timing ------------------------------------------------------------------------

    def peak_stashed_bytes(self) -> int:
        """The most bytes this rank's 2BP engine kept for W at once in the last step.

        Sampled after every ``I``; 0 without 2BP.
        """
        return self._steps.peak_stashed_bytes

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """What this rank held in the last training step, in bytes, measured.

        Args:
            optimizer: the optimizer of this rank's parameters, whose state
                is counted under ``"optimizer"``; None counts 0 (the pipeline
                does not know the optimizer otherwise).

        Returns:
            ``activations``: the most held at once from ``F`` until ``I`` (or
            ``B``); ``stash``: the most held at once from ``I`` until ``W``;
            ``parameters``: parameters, gradients and buffers; ``optimizer``;
            ``peak``: on CUDA ``torch.cuda.max_memory_allocated`` since the
            step started, elsewhere ``parameters + optimizer`` plus the most
            held at once between passes and, when gradients are accumulated
            over steps, the earlier steps' gradients held aside. Tensors are
            counted by storage, each once (see :mod:`twobp.runtime.execution.memory`).
        """
        return memory_stats(
            self._memory, self.module, optimizer, self._earlier_gradients.last_nbytes
        )

    @property
    def local_spans(self) -> list[Span]:
        """The compute spans of this rank in the last step (seconds from its start)."""
        return list(self._steps.spans)

    @property
    def compile_choice(self) -> dict[int, str | None]:
        """With ``compile=True``: how each of this rank's stages runs its blocks, ``"compiled"``
        or ``"eager"``, as the first training steps timed them (None until they have; see
        :mod:`twobp.runtime.setup.compile_trial`); ``"compiled"`` for every stage with
        ``compile={"stages": "compiled"}``. Empty without ``compile``."""
        if self._compile is None:
            return {}
        if self._compile_trial is None:
            return dict.fromkeys(self.stages, "compiled")
        return dict(self._compile_trial.choice)

    @property
    def step_times(self) -> StepTimes:
        """Where this rank's last step went outside its compute: dispatch, sends, receives.

        Host seconds (see :class:`~twobp.runtime.execution.step_run.StepTimes`).
        """
        return self._steps.times

    def timeline(self, waits: bool = False) -> list[Span]:
        """The last step's compute spans of every rank, merged. Collective.

        Times are seconds from the step start, which the all-reduce that opens every
        step aligns across ranks.

        Args:
            waits: also the time each rank waited on its peers: every receive
                (a span of its ``RECV`` action, from posting it until the tensors
                arrived) and the wait for the gradient reductions at the end of
                the step (a span of the rank's last ``R``, after its compute).
                They are not compute: ``bubble_ratio`` counts them as idle.
        """
        self.state.check_open()
        spans = [*self._steps.spans, *(self._steps.waits if waits else ())]
        mine = [(s.rank, str(s.action), s.start, s.end) for s in spans]
        merged = [
            Span(r, Action.parse(a), start, end)
            for spans in collective.all_gather_objects(self.topology.members, mine)
            for r, a, start, end in spans
        ]
        return sorted(merged, key=lambda s: (s.rank, s.start))


def _trials(
    blocks: list[nn.Module],
    given: _Given,
    members: Membership,
    device: torch.device,
    sample: Batch | None = None,
) -> Trials | None:
    """The trial steps of ``schedule="auto"``: each contender a pipeline built with this
    pipeline's options but the contender's prepared schedule and partition, stepping on
    the first step's batch ``sample`` or the example input repeated (None without either)."""
    if given.example_input is None and sample is None:
        return None
    options = given.options

    def build(contender: Contender) -> Pipeline:
        trial = replace(
            options,
            schedule=contender.schedule,
            n_microbatches=None,
            two_bp=is_split(contender.schedule),
            partition=list(contender.partition),
            stages_per_rank=None,
            # The contender is prepared: nothing is profiled, costed or bounded again
            # (what it rebuilds is in its schedule).
            costs=None,
            memory_limit=None,
            recompute=None if options.rebuilds else options.recompute,
            nonfinite="skip",
            auto_trials=0,
        )
        # Trial steps take no optimizer step: the scaler stays with the pipeline.
        return Pipeline(
            blocks, stand_in_loss, options=trial, device=device, group=given.group, mesh=given.mesh
        )

    return partial(
        run_trials,
        build=build,
        blocks=blocks,
        example_input=given.example_input,
        batch=sample,
        world=members,
        device=device,
        timeout=options.timeout,
    )


@dataclass(frozen=True)
class _Given:
    """What planning takes: the options, and the live resources the pipeline does not keep
    once planned (the example input, the process group or mesh the trials are built on)."""

    options: PipelineOptions
    example_input: Batch | None
    group: dist.ProcessGroup | None
    mesh: Any


_OPTION_NAMES = frozenset(f.name for f in fields(PipelineOptions))


@dataclass(frozen=True)
class _Pending:
    """What a pipeline that plans at its first step builds its stages from then."""

    blocks: list[nn.Module]
    names: Any
    loss_fn: LossFn
    given: _Given
    members: Membership
    grid: list[list[int]]

    @property
    def model(self) -> nn.Sequential:
        """Every block, as ``nn.Sequential(*blocks)`` names them (a tied weight once)."""
        return nn.Sequential(OrderedDict((str(i), b) for i, b in enumerate(self.blocks)))

    def named(self, named: Iterator[tuple[str, _T]], prefix: str) -> Iterator[tuple[str, _T]]:
        """``named`` (block names) in the names the planned pipeline will give."""
        if self.names is None:
            return ((prefix + n, t) for n, t in named)
        return ((prefix + n, t) for n, t in ModelNames(self.names).named(named))


def _plans_at_first_step(
    given: _Given, members: Membership, device: torch.device, timeout: float
) -> bool:
    """True if ``schedule="auto"`` plans on the first step's batch: with
    ``n_microbatches="auto"``, or where no rank was given an example input and
    nothing else is to plan by (collective where it depends on the example input)."""
    options = given.options
    planned = isinstance(options.schedule, str) and (
        options.schedule == AUTO or (options.rebuilds and options.schedule in SCHEDULES)
    )
    if not planned or options.costs is not None:
        return False
    if options.n_microbatches == AUTO_MICROBATCHES:
        return True
    # Alike on every rank: if any has an example input, all plan now (and those without
    # one are refused there, naming what they lack).
    table = agree(
        members, device, timeout, None, "building the pipeline", [given.example_input is not None]
    )
    return not any(row[0] for row in table)


def _detached(batch: Batch) -> Batch:
    tensors, is_tuple = flatten(batch)
    return unflatten([t.detach() for t in tensors], is_tuple)


def _check_grad_scaler(scaler: object, pipe: Pipeline) -> None:
    """Refuse a scaler that cannot agree across ranks, or that another pipeline holds, at once."""
    if scaler is None:
        return
    if isinstance(scaler, GradScaler):
        if scaler.belongs_elsewhere(pipe):
            raise PipelineConfigError(
                "grad_scaler belongs to another open pipeline: close that one first "
                "(pipe.close()), or give each pipeline its own twobp.GradScaler"
            )
        return
    if isinstance(scaler, torch.amp.GradScaler):
        raise PipelineConfigError(
            "grad_scaler is a torch.amp.GradScaler, which looks only at this rank's gradients "
            "(one rank would skip a step that another applies); use twobp.GradScaler, which "
            "takes the same arguments and methods"
        )
    raise PipelineConfigError(
        f"grad_scaler must be a twobp.GradScaler or None, not {type(scaler).__name__}"
    )
