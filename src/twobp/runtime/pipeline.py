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

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from twobp.runtime.base.group import (
    default_device,
    set_threads_per_rank,
)
from twobp.runtime.base.process_state import close_at_exit, forget
from twobp.runtime.base.topology import Topology
from twobp.runtime.errors import (
    PipelineClosedError,
    PipelineConfigError,
)
from twobp.runtime.execution.microbatch import (
    Batch,
)
from twobp.runtime.execution.stage import LossFn, Stage
from twobp.runtime.execution.step_run import StepTimes
from twobp.runtime.options import (
    CONTENDERS,
    CostsArgument,
    PipelineOptions,
)
from twobp.runtime.setup import pipeline_plan
from twobp.runtime.setup.auto.plan import AutoPlan
from twobp.runtime.setup.build_rank import build_rank, contender_trials
from twobp.runtime.setup.compiled_stages import compile_options
from twobp.runtime.setup.data_parallel import data_parallel_grid
from twobp.runtime.setup.first_step import Pending, first_batch, plans_at_first_step
from twobp.runtime.setup.host_memory import retain_freed_memory
from twobp.runtime.setup.join import join_shard
from twobp.runtime.setup.loss_parallel import parallel_loss
from twobp.runtime.setup.rank_parts import PlannedPart, RankParts
from twobp.runtime.setup.replicas import tied_across_blocks
from twobp.runtime.setup.resources import check_autocast, check_grad_scaler, rank_device
from twobp.runtime.setup.sharded_parameters import refuse_full_parameters
from twobp.runtime.setup.tensor_parallel import shard_blocks
from twobp.runtime.state import checkpoint
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.runtime.state.model_names import ModelNames
from twobp.runtime.state.model_state import PipelineState
from twobp.schedule.schedule import Schedule
from twobp.sim.rebuild_choice import RebuildChoice
from twobp.sim.split_choice import SplitChoice
from twobp.timeline import Span

_F = TypeVar("_F", bound=Callable[..., Any])


def _same_doc(method: Callable[..., Any]) -> Callable[[_F], _F]:
    """Give the decorated method the docstring of ``method`` (the state's method it calls)."""

    def document(delegate: _F) -> _F:
        delegate.__doc__ = method.__doc__
        return delegate

    return document


class Pipeline:
    """A model run as a pipeline of stages over the ranks of a process group.

    A thin facade over two things: the plan every rank runs (the schedule and
    the blocks of every stage, :mod:`twobp.runtime.setup.pipeline_plan`) and
    this rank's parts built from it (stages, reducer, model state, step runner:
    :class:`twobp.runtime.setup.rank_parts.RankParts`). A pipeline that plans
    on its first step's batch (``schedule="auto"``, or a V-shaped schedule with no
    partition to balance, without ``example_input``; or ``n_microbatches="auto"``)
    has no parts until then (see :meth:`plan_on`).

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
        schedule, n_microbatches, two_bp, partition and every other keyword
            not listed here: the fields of
            :class:`twobp.runtime.options.PipelineOptions`, documented there.
        options: the options whole (``PipelineOptions``); a keyword given
            besides them that is not its field's default changes that option.
        device: this rank's device; None picks ``cuda:LOCAL_RANK`` if CUDA is
            available and the backend can use it (NCCL), else the CPU.
        group: the process group to use; None uses the default group (initialised
            from ``torchrun``'s environment if needed), or a single process world.
        mesh: a ``torch.distributed.device_mesh.DeviceMesh`` with dims ``("dp", "pp")``
            that lays out the data-parallel copies, or ``("dp", "pp", "tp")`` /
            ``("pp", "tp")`` laid out as twobp lays out ``data_parallel`` x pipeline x
            ``tensor_parallel`` (which it then gives).
        example_input: one micro-batch of model inputs, on which rank 0
            profiles the blocks (``partition="balanced"``, ``two_bp=None``,
            ``costs="profile"``, ``schedule="auto"``, ``recompute="auto"``).
        grad_scaler: a :class:`twobp.GradScaler` for float16 (with
            ``autocast=torch.float16``): every micro-batch's loss is scaled
            before its backward, and overflows are agreed over every rank, so
            all skip or step together (see :mod:`twobp.runtime.state.grad_scaler`).

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

    _closed_unplanned = False  # closed before it planned (see close())
    plan: AutoPlan | None = None
    """What ``schedule="auto"`` (or ``costs="profile"``) chose: its candidate, the
    ranking, the predicted step time (``print`` shows it); None otherwise, and until
    the first step where ``auto`` plans on that step's inputs."""
    two_bp_choice: SplitChoice | None = None
    """With ``two_bp=None`` and an example input: which stages split their
    backward, with the predicted steps (:class:`twobp.sim.split_choice.SplitChoice`);
    None otherwise."""
    rebuild_choice: RebuildChoice | None = None
    """With ``recompute="auto"`` on a schedule by name: whether the schedule fit
    ``memory_limit`` as it is or how many stashes are rebuilt, with the predicted
    peaks and steps (:class:`twobp.sim.rebuild_choice.RebuildChoice`); None otherwise."""
    partition_by: str | None = None
    """How the blocks were cut into stages, in words (given, balanced on the example
    input, uniform, or ``schedule="auto"``'s choice); None until planned."""

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
        shard_parameters: bool = False,
        scatter_each_w: bool | None = False,
        tensor_parallel: int | None = None,
        tensor_parallel_plan: Any = None,
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
        self.options = (options or PipelineOptions()).updated(keywords)
        """What this pipeline was built with (:class:`twobp.runtime.options.PipelineOptions`):
        ``options``, with every keyword given that is not its default taken instead."""
        self.options.check()
        self._parts: RankParts | None = None
        self._compile = compile_options(self.options.compile)
        check_grad_scaler(grad_scaler, self)
        self.timeout = float(self.options.timeout)
        requested = torch.device(device) if device is not None else None
        world, members, self._tensor, given = join_shard(
            requested or default_device(), group, self.options, mesh, example_input, blocks
        )
        self.options = given.options  # at the tensor-parallel size decided, if a range
        self.tp_rank, self.tp_size = (0, 1) if self._tensor is None else self._tensor.place
        """This rank's index in its tensor-parallel group, and the group's size (0, 1: none)."""
        self.device = rank_device(requested, members)
        """The device this rank computes on."""
        self.rank = members.rank
        """This process's rank in the process group."""
        self.autocast = self.options.autocast
        """The dtype every stage's forward runs under ``torch.autocast`` with, or None."""
        check_autocast(self.device, self.autocast, self.rank)
        set_threads_per_rank(members.local_size, self.options.num_threads)
        if self.options.retain_host_memory and self.device.type == "cpu":
            retain_freed_memory()
        grid = data_parallel_grid(members, self.options.data_parallel, given.mesh)
        self.grad_scaler = grad_scaler
        """The :class:`twobp.GradScaler` that scales this pipeline's losses, or None."""
        if grad_scaler is not None:
            # Overflow agreed over every rank: the shards of a step are skipped together.
            grad_scaler.bind(self, world, self.device, self.timeout)
        # Known before planning, so that each copy can pass its own part of the first batch.
        self.dp_rank = next(d for d, row in enumerate(grid) if members.rank in row)
        """Which copy of the pipeline this process belongs to (0 without data parallel)."""
        self.dp_size = len(grid)
        """How many copies of the pipeline run side by side."""
        self._pending: Pending | None = Pending.of(blocks, loss_fn, given, members, grid)
        if not plans_at_first_step(given, members, self.device, self.timeout, len(grid[0])):
            self._ensure_planned(None)
        close_at_exit(self)

    def _ensure_planned(self, sample: Batch | None) -> RankParts:
        """This rank's parts; planned and built now (on ``sample``, the first step's
        inputs, shared from rank 0) if not yet. Collective when it plans."""
        if self._parts is not None:
            return self._parts
        pending = self._pending
        if pending is None:
            raise PipelineClosedError(
                f"rank {self.rank}: this pipeline was closed; build a new Pipeline to go on"
            )
        given, members = pending.given, pending.members
        plan = pipeline_plan.plan(
            pending.blocks,
            given.options,
            members,
            self.device,
            sample,
            example_input=given.example_input,
            pipeline_ranks=pending.grid[0],
            trials=contender_trials(
                pending.blocks,
                given.options,
                given.example_input,
                members,
                self.device,
                pending.grid,
                sample,
            ),
            data_parallel=len(pending.grid),
            tied=tied_across_blocks(pending.blocks),
            decided=given.decided,
        )
        self.plan, self.two_bp_choice, self.rebuild_choice = plan.auto, plan.two_bp, plan.rebuilds
        self.partition_by = plan.partition_by
        loss_fn = pending.loss_fn
        if self._tensor is not None:
            shard_blocks(pending.blocks, given.options.tensor_parallel_plan, self._tensor)
            loss_fn = parallel_loss(pending.blocks, loss_fn)
        self._parts = build_rank(
            plan,
            pending.blocks,
            loss_fn,
            members,
            self.device,
            given.options,
            pending.grid,
            names=None if pending.names is None else ModelNames(pending.names),
            compile=self._compile,
            grad_scaler=self.grad_scaler,
        )
        # The pipeline keeps neither the blocks it does not run, nor the process group or
        # mesh (destroying the group ends it, see close()), nor the example micro-batch.
        self._pending = None
        self._parts.state.tensor_parallel = self._tensor
        return self._parts

    def plan_on(self, inputs: Batch | None) -> None:
        """Plan now on this batch of inputs, as the first step does. Collective.

        A pipeline that plans on its first step's batch (``schedule="auto"`` or a V-shaped
        schedule to balance, without ``example_input``; or ``n_microbatches="auto"``) does it
        here instead: to :meth:`load`
        a checkpoint into the planned stages, say. Nothing happens once planned.

        Args:
            inputs: the batch of model inputs (only rank 0's counts; others may pass None).

        Raises:
            PipelineConfigError: on every rank, if rank 0 has no inputs or they do not split;
                and what planning raises.
        """
        if self._parts is None and self._pending is not None:
            self._ensure_planned(first_batch(self._pending, inputs, self.rank, self.timeout))

    def _planned(self, name: str) -> RankParts:
        """The parts, for ``name``, which a pipeline has only once planned."""
        if self._parts is not None:
            return self._parts
        if self._closed_unplanned:
            raise PipelineClosedError(
                f"rank {self.rank}: this pipeline was closed; build a new Pipeline to go on"
            )
        raise PipelineConfigError(
            f"rank {self.rank}: this pipeline plans its schedule on the first step's batch "
            "(schedule='auto' or a V-shaped schedule to balance, without example_input; or "
            "n_microbatches='auto') and has no "
            f"{name} until then: run a step first, or call plan_on(inputs)"
        )

    # -- what the plan and the parts say -------------------------------------------------

    schedule = PlannedPart[Schedule](
        lambda parts: parts.schedule,
        "The compute schedule every pipeline rank runs (ranks of the schedule: pipeline ranks).",
    )
    lowered_schedule = PlannedPart[Schedule](
        lambda parts: parts.lowered_schedule,
        "The schedule with its transfers between ranks: what this pipeline runs.",
    )
    topology = PlannedPart[Topology](
        lambda parts: parts.topology, "Which process runs each stage, and which hold its replicas."
    )
    pp_rank = PlannedPart[int](
        lambda parts: parts.pp_rank, "This process's pipeline rank: its row of the schedule."
    )
    n_microbatches = PlannedPart[int](
        lambda parts: parts.schedule.n_microbatches,
        "Micro-batches per step (of this copy's part of the batch).",
    )
    recompute = PlannedPart[tuple[str | None, ...]](
        lambda parts: parts.recompute,
        "The recompute mode of every stage (None: none); a list names one per model stage.",
    )
    stage_blocks = PlannedPart[tuple[range, ...]](
        lambda parts: parts.stage_blocks,
        "The block indices of every stage (all stages, not only this rank's).",
    )
    module = PlannedPart[nn.Sequential](
        lambda parts: parts.module, "This rank's blocks, named by their index in the whole model."
    )
    stages = PlannedPart[dict[int, Stage]](
        lambda parts: parts.stages, "This rank's stages, by stage."
    )
    state = PlannedPart[PipelineState](
        lambda parts: parts.state,
        "This rank's blocks as a model: parameters, state dicts, checkpoints "
        "(:class:`twobp.runtime.state.model_state.PipelineState`).",
    )
    skipped_steps = PlannedPart[list[int]](
        lambda parts: parts.settlement.skipped_steps,
        'Indices of the steps skipped for a non-finite loss (``nonfinite="skip"``).',
    )
    last_step_skipped = PlannedPart[bool](
        lambda parts: parts.settlement.last_step_skipped,
        "True if the last step's loss was not finite and its gradients were dropped.",
    )

    @property
    def nonfinite(self) -> str:
        """``"raise"`` or ``"skip"`` a step whose mean loss is not finite."""
        return self.options.nonfinite

    # -- the model state (this rank's blocks as a model; see PipelineState) -----------

    step_count = PlannedPart[int](
        lambda parts: parts.state.step_count,
        "Steps run so far (restored by :meth:`load`); the index of the next step.",
    )

    background_saves = PlannedPart[checkpoint.BackgroundSaves](
        lambda parts: parts.state.background_saves,
        "The checkpoint being written in the background (``save(..., async_save=True)``).",
    )

    written_blocks = PlannedPart[frozenset[int]](
        lambda parts: parts.state.written_blocks,
        "The blocks whose entries this process writes to a checkpoint (one copy each).",
    )

    @_same_doc(PipelineState.parameters)
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        refuse_full_parameters(self.options, self.rank)
        if self._pending is not None:  # every block's until the first step plans
            return self._pending.model.parameters(recurse)
        return self.state.parameters(recurse)

    @_same_doc(PipelineState.named_parameters)
    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        refuse_full_parameters(self.options, self.rank)
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

        Every step completes its own transfers, so between steps nothing is in flight;
        after a step that failed part-way, the transfers it posted are abandoned here, and
        the weight-gradient work it left is dropped. The parameters and their gradients
        stay as they are, and the blocks are released: another pipeline may be built on
        them. Later calls of ``step``, ``eval_step``, ``timeline``, ``save``, ``load`` and
        ``clip_grad_norm_`` raise :class:`PipelineClosedError`. Idempotent; the runtime
        closes every pipeline still open when the interpreter exits. Not collective.
        """
        if self._parts is None:
            if self._pending is not None or self._closed_unplanned:
                self._pending, self._closed_unplanned = None, True
                forget(self)
            return
        if self._parts.state.closed:
            return
        forget(self)
        if self.grad_scaler is not None:
            self.grad_scaler.unbind(self)
        self._parts.close()

    @_same_doc(RankParts.release_blocks)
    def release_blocks(self) -> None:
        self._planned("release_blocks").release_blocks()

    @_same_doc(RankParts.claim_blocks)
    def claim_blocks(self) -> None:
        self._planned("claim_blocks").claim_blocks()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- training and evaluation ---------------------------------------------------

    @property
    def needs_inputs(self) -> bool:
        """True if this rank runs a first stage of the model and needs the batch of inputs
        (under Chimera, the ranks of both pipelines' first stages)."""
        schedule, stages = self._placed()
        return any(schedule.model_stage(s) == 0 for s in stages)

    @property
    def needs_targets(self) -> bool:
        """True if this rank runs a last stage of the model and needs the batch of targets."""
        schedule, stages = self._placed()
        last = schedule.pipeline_stages - 1
        return any(schedule.model_stage(s) == last for s in stages)

    def _placed(self) -> tuple[Schedule, list[int]]:
        """The schedule's layout and this rank's stages in it (before planning where only
        the partition is left to plan: a V balanced at its first step)."""
        early = self._pending.placed() if self._parts is None and self._pending else None
        return early or (self.schedule, list(self.stages))

    @_same_doc(RankParts.step)
    def step(self, inputs: Batch | None, targets: Batch | None) -> float:
        self.plan_on(inputs)
        return self._planned("step").step(inputs, targets)

    @_same_doc(RankParts.shard_optimizer)
    def shard_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], **optimizer_kwargs: Any
    ) -> torch.optim.Optimizer:
        return self._planned("shard_optimizer").shard_optimizer(optimizer_class, **optimizer_kwargs)

    @_same_doc(RankParts.eval_step)
    def eval_step(self, inputs: Batch | None, targets: Batch | None = None) -> Any:
        self.plan_on(inputs)
        return self._planned("eval_step").eval_step(inputs, targets)

    # -- timing ------------------------------------------------------------------------

    def peak_stashed_bytes(self) -> int:
        """The most bytes this rank's 2BP engine kept for W at once in the last step.

        Sampled after every ``I``; 0 without 2BP.
        """
        return self._planned("peak_stashed_bytes").runner.peak_stashed_bytes

    @_same_doc(RankParts.memory_stats)
    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        return self._planned("memory_stats").memory_stats(optimizer)

    local_spans = PlannedPart[list[Span]](
        lambda parts: list(parts.runner.spans),
        "The compute spans of this rank in the last step (seconds from its start).",
    )

    @property
    def compile_choice(self) -> dict[int, str | None]:
        """With ``compile=True``: how each of this rank's stages runs its blocks, ``"compiled"``
        or ``"eager"``, as the first training steps timed them (None until they have; see
        :mod:`twobp.runtime.setup.compile_trial`); ``"compiled"`` for every stage with
        ``compile={"stages": "compiled"}``. Empty without ``compile``."""
        if self._compile is None:
            return {}
        parts = self._planned("compile_choice")
        if parts.compile_trial is None:
            return dict.fromkeys(parts.stages, "compiled")
        return dict(parts.compile_trial.choice)

    step_times = PlannedPart[StepTimes](
        lambda parts: parts.runner.times,
        "Where this rank's last step went outside its compute: dispatch, sends, receives "
        "(host seconds, see :class:`~twobp.runtime.execution.step_run.StepTimes`).",
    )

    @_same_doc(RankParts.timeline)
    def timeline(self, waits: bool = False) -> list[Span]:
        return self._planned("timeline").timeline(waits)


_OPTION_NAMES = frozenset(f.name for f in fields(PipelineOptions))
