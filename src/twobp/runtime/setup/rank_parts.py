"""One rank's parts of a planned pipeline, and how they step.

:class:`RankParts` holds what this rank runs of a plan: its stages, the reducer
of replicated gradients, the model state, the lowered schedule, the step runner
and the settlement of each step's gradients (built by
:func:`twobp.runtime.setup.build_rank.build_rank`). :class:`twobp.runtime.Pipeline`
holds one once planned; the trial steps of ``schedule="auto"`` build one per
contender and step it directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, overload

import torch
from torch import nn

from twobp.runtime.base.topology import Topology
from twobp.runtime.communication import collective
from twobp.runtime.communication.layout_cache import LayoutCache
from twobp.runtime.communication.reduction import GradientReducer
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.memory import MemoryMeter, memory_stats, storages
from twobp.runtime.execution.microbatch import concat_microbatches, unflatten
from twobp.runtime.execution.stage import Stage
from twobp.runtime.execution.step_runner import StepRunner
from twobp.runtime.execution.step_start import StepBatches, StepInputs, start_step
from twobp.runtime.options import Batch
from twobp.runtime.setup.compile_trial import CompileTrial
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.runtime.state.model_state import PipelineState
from twobp.runtime.state.optimizer_and_rng import parameter_names
from twobp.runtime.state.settlement import Settlement
from twobp.runtime.state.sharded_optimizer import shard_optimizer
from twobp.schedule.action import Action
from twobp.schedule.lowering import add_communication, forward_only
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import CommPlan, plan_communication
from twobp.timeline import Span


@dataclass
class RankParts:
    """What one rank runs of a planned pipeline, and how it steps.

    Args:
        schedule: the compute schedule every pipeline rank runs.
        topology: which process runs each stage, and which hold its replicas.
        stage_blocks: the block indices of every stage of the model.
        recompute: the recompute mode of every stage (None: none).
        module: this rank's blocks, named by their index in the whole model.
        stages: this rank's stages, by stage.
        state: this rank's blocks as a model (parameters, checkpoints).
        lowered_schedule: the schedule with its transfers between ranks.
        runner: runs the lowered schedule of one step.
        settlement: keeps, divides or drops each step's gradients.
        reducer: the reductions of replicated gradients (None: none here).
        memory: what the stages hold, measured.
        grad_scaler: the loss scaler, or None.
        compile_trial: with ``compile=True``, the first steps' timing of each
            stage compiled and eager.
    """

    schedule: Schedule
    topology: Topology
    stage_blocks: tuple[range, ...]
    recompute: tuple[str | None, ...]
    module: nn.Sequential
    stages: dict[int, Stage]
    state: PipelineState
    lowered_schedule: Schedule
    runner: StepRunner
    settlement: Settlement
    reducer: GradientReducer | None
    memory: MemoryMeter
    grad_scaler: GradScaler | None = None
    compile_trial: CompileTrial | None = None
    released: bool = False
    _comm: CommPlan | None = None
    _layouts: LayoutCache = field(default_factory=LayoutCache)
    _eval_layouts: LayoutCache = field(default_factory=LayoutCache)
    _forward: tuple[Schedule, CommPlan] | None = None
    _start_buffer: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.topology.rank

    @property
    def pp_rank(self) -> int:
        """This process's pipeline rank: its row of the schedule."""
        return self.topology.pp_rank

    # -- steps -----------------------------------------------------------------------

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
        self.state.check_open()
        if self.released:
            raise PipelineConfigError(
                f"rank {self.rank}: this pipeline released its blocks (release_blocks()); "
                "call claim_blocks() before its next step"
            )
        batches = self._prepare(inputs, targets, training=True)
        scale = 1.0 if self.grad_scaler is None else self.grad_scaler.loss_scale()
        for stage in self.stages.values():
            stage.set_loss_scale(scale)
        self.settlement.begin()
        if self.compile_trial is not None:
            self.compile_trial.before_step()
        assert self._comm is not None
        try:
            _, end = self.runner.run_step(self.lowered_schedule, self._comm, batches, True)
        except BaseException:
            self.settlement.failed()
            self._layouts.forget(batches.code)
            raise
        if self.compile_trial is not None:
            self.compile_trial.after_step(self.runner.spans)
        step = self.state.step_count
        self.state.step_count += 1
        return self.settlement.finish(end, step)

    @torch.no_grad()
    def eval_step(self, inputs: Batch | None, targets: Batch | None) -> Any:
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
        self.state.check_open()
        if self._forward is None:
            forward = forward_only(self.schedule)
            self._forward = (add_communication(forward), plan_communication(forward, self.pp_rank))
        schedule, comm = self._forward
        # Layouts of their own: no gradient flags, and other shapes than training's.
        batches = self._prepare(inputs, targets, training=False)
        try:
            result, end = self.runner.run_step(schedule, comm, batches, False)
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
        n = self.schedule.n_microbatches
        return concat_microbatches([unflatten(*outputs[m]) for m in range(n)])

    def _gather_outputs(self, outputs: dict[int, Any]) -> dict[int, Any]:
        """Every pipeline's outputs of this copy, on the rank of the first pipeline's last
        stage (empty elsewhere). Collective."""
        mine = {m: (tuple(t.cpu() for t in ts), is_tuple) for m, (ts, is_tuple) in outputs.items()}
        every = collective.all_gather_objects(self.topology.members, mine)
        if self.rank != self.topology.rank_of_stage(self.schedule.pipeline_stages - 1):
            return {}
        device = self.state.device
        gathered: dict[int, Any] = {}
        for rank in self.topology.pipeline_ranks:
            for m, (ts, is_tuple) in every[rank].items():
                gathered[m] = (tuple(t.to(device) for t in ts), is_tuple)
        return gathered

    def _prepare(self, inputs: Batch | None, targets: Batch | None, training: bool) -> StepBatches:
        schedule = self.schedule
        last = schedule.pipeline_stages - 1
        assert self._start_buffer is not None
        return start_step(
            self.topology,
            self.state.device,
            self.state.timeout,
            StepInputs(inputs, targets, training, self.state.step_count),
            schedule.n_microbatches,
            self._layouts if training else self._eval_layouts,
            self._start_buffer,
            (schedule.replicas_of(0), schedule.replicas_of(last)),
        )

    # -- the blocks, the optimizer and the end ---------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset this rank's gradients (a sharded optimizer's shards too)."""
        self.state.zero_grad(set_to_none)

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
        self.released = True

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
        self.released = False

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
        self.state.settle_parameters()
        optimizer, sharded = shard_optimizer(
            optimizer_class,
            optimizer_kwargs,
            reducer=self.reducer,
            schedule=self.schedule,
            pp_rank=self.pp_rank,
            stage_modules={s: stage.module for s, stage in self.stages.items()},
            names=parameter_names(self.state.named_parameters()),
            rank=self.rank,
            timeout=self.state.timeout,
            existing=self.state.sharded,
        )
        self.state.sharded = sharded
        self.runner.wait_parameters = sharded.wait
        return optimizer

    def close(self) -> None:
        """Drop what this rank holds of communication and of unfinished steps, and free
        the blocks for another pipeline (parameters and gradients stay). Idempotent."""
        if self.state.closed:
            return
        self.state.closed = True
        for stage in self.stages.values():
            stage.abandon_step()
            # The blocks are free again: another pipeline may be built on them.
            stage.gradients.restore()
        self.runner.abandon_reductions()
        if self.state.sharded is not None:
            self.state.sharded.abandon()
        self._layouts.clear()
        self._eval_layouts.clear()
        self._forward = None

    # -- what the last step measured ---------------------------------------------------

    def memory_stats(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
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

            With ``shard_parameters=True``: ``parameters`` counts this rank's
            shards and their gradients, held between steps (the steady state;
            the full parameters hold nothing then), and ``gathered_peak`` the
            most bytes of gathered full parameters held at once in the step,
            which the CPU's ``peak`` adds; ``peak_freed_before_w``: the most bytes of
            activations, stashes, whole gradients and gathered weights held at once after
            a compute action (measured), and ``peak_freed_after_w`` the same had each stage
            kept its weights through its last ``W`` (the same activations, stashes and
            gradients); ``whole_gradients_peak``: the most bytes of whole gradients held
            after a compute action (before their reduce-scatter: from a stage's first
            ``W`` to its ``R``, or within each ``W`` where they are reduce-scattered after
            each, see ``scatter_each_w``), which the CPU's ``peak`` adds;
            ``scatter_each_w``: 1 if some stage of this rank reduce-scattered its
            gradients after each ``W`` in the last step, else 0; ``scattering_peak``: the
            most bytes of whole gradients held by reduce-scatters still in flight after an
            action (not in the peaks above; depends on how soon each completes).
        """
        earlier = self.settlement.earlier.last_nbytes
        stats = memory_stats(self.memory, self.module, optimizer, earlier)
        sharded = self.state.sharded
        if sharded is None or sharded.resident:
            return stats
        masters = [s.master for s in sharded.shards]
        held = sum(storages(masters).values())
        if sharded.steps(optimizer):
            stats["optimizer"] -= held  # counted there as the optimizer's own parameters
        else:
            held += sum(storages(m.grad for m in masters if m.grad is not None).values())
            stats["peak"] += held
        stats["parameters"] += held
        stats["gathered_peak"] = sharded.gathered_peak
        stats["peak_freed_before_w"] = sharded.peak_freed_before_w
        stats["peak_freed_after_w"] = sharded.peak_freed_after_w
        stats["whole_gradients_peak"] = sharded.whole_gradients_peak
        stats["scatter_each_w"] = int(sharded.scattered_each_w)
        stats["scattering_peak"] = sharded.scattering_peak
        if self.memory.device.type != "cuda":
            stats["peak"] += sharded.gathered_peak + sharded.whole_gradients_peak
        return stats

    def timeline(self, waits: bool) -> list[Span]:
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
        spans = [*self.runner.spans, *(self.runner.waits if waits else ())]
        mine = [(s.rank, str(s.action), s.start, s.end) for s in spans]
        merged = [
            Span(r, Action.parse(a), start, end)
            for spans in collective.all_gather_objects(self.topology.members, mine)
            for r, a, start, end in spans
        ]
        return sorted(merged, key=lambda s: (s.rank, s.start))


class Planned(Protocol):
    """What holds a rank's parts once planned (``twobp.runtime.Pipeline``)."""

    def _planned(self, name: str) -> RankParts: ...


V = TypeVar("V")


class PlannedPart(Generic[V]):
    """An attribute of a pipeline that it has once planned, read from its parts; before,
    the error that says to run a step first or to call ``plan_on`` (``_planned``)."""

    def __init__(self, read: Callable[[RankParts], V], doc: str) -> None:
        self._read = read
        self.__doc__ = doc
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, holder: None, owner: type) -> PlannedPart[V]: ...

    @overload
    def __get__(self, holder: Planned, owner: type) -> V: ...

    def __get__(self, holder: Planned | None, owner: type) -> PlannedPart[V] | V:
        if holder is None:
            return self
        return self._read(holder._planned(self._name))
