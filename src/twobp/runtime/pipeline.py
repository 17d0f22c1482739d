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
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from twobp.partition import stage_ranges
from twobp.runtime import collective
from twobp.runtime.backward import stage_gradients
from twobp.runtime.clock import StepClock
from twobp.runtime.comm import Layouts, StepChannel
from twobp.runtime.comm_plan import CommPlan, forward_only, plan_communication
from twobp.runtime.dispatcher import StepResult, StepRun
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.grad_norm import clip_grad_norm_
from twobp.runtime.group import default_device, device_for, join_world, set_threads_per_rank
from twobp.runtime.microbatch import Batch, concat_microbatches, split_batch, to_device, unflatten
from twobp.runtime.partition import balanced_counts, check_no_shared_parameters, stage_counts
from twobp.runtime.resolve import resolve_schedule
from twobp.runtime.stage import LossFn, Stage
from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule
from twobp.timeline import Span


class Pipeline:
    """A model run as a pipeline of stages over the ranks of a process group.

    Args:
        blocks: the whole model as an ``nn.Sequential`` or a list of modules,
            built identically on every rank. Blocks pass a tensor or a tuple
            of tensors to the next; non-float tensors (masks, ids) get no
            gradient. Only this rank's blocks are kept: pass blocks you do not
            hold elsewhere, so the others are freed.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over one micro-batch.
        schedule: a name of :data:`twobp.schedule.SCHEDULES`, a ``Schedule``,
            or the path of a CSV file.
        n_microbatches: micro-batches per step; None takes a Schedule's or
            CSV's own count, and 8 for a name.
        two_bp: split each backward into ``I`` and ``W`` (placing ``W`` by
            ``two_bp_policy``); False runs fused ``B`` (split schedules are merged).
        partition: blocks per stage (one int per stage), ``"uniform"`` or None (uniform).
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

    Raises:
        PipelineConfigError: if the schedule, partition or model do not fit.
        twobp.schedule.ScheduleError: if the schedule is incomplete or deadlocks.
    """

    def __init__(
        self,
        blocks: nn.Sequential | Sequence[nn.Module],
        loss_fn: LossFn,
        schedule: str | os.PathLike[str] | Schedule = "1f1b",
        n_microbatches: int | None = None,
        two_bp: bool = True,
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
    ) -> None:
        self.timeout = float(timeout)
        requested = torch.device(device) if device is not None else None
        self.world = join_world(requested or default_device(), self.timeout, group)
        self.device = requested if requested is not None else device_for(self.world)
        """The device this rank computes on."""
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = default_device()
            # Collectives of objects (timeline, balanced partition) use the current device.
            torch.cuda.set_device(self.device)
        self.rank = self.world.rank
        set_threads_per_rank(self.world.local_size, num_threads)
        self.schedule = resolve_schedule(
            schedule,
            n_ranks=self.world.size,
            n_microbatches=n_microbatches,
            two_bp=two_bp,
            policy=two_bp_policy,
            stages_per_rank=stages_per_rank,
        )
        self.n_microbatches = self.schedule.n_microbatches
        self._weight_group_size = weight_group_size
        all_blocks = list(blocks)
        n_stages = self.schedule.n_stages
        counts = stage_counts(len(all_blocks), n_stages, partition)
        if counts is None:
            counts = balanced_counts(all_blocks, n_stages, example_input, self.world, self.device)
        ranges = tuple(stage_ranges(counts))
        check_no_shared_parameters(all_blocks, ranges, self.schedule.placement)
        self.stage_blocks = ranges
        """The block indices of every stage (all stages, not only this rank's)."""
        mine = self.schedule.stages_of(self.rank)
        self.module = nn.Sequential(
            OrderedDict((str(i), all_blocks[i]) for s in mine for i in ranges[s])
        ).to(self.device)
        """This rank's blocks, named by their index in the whole model."""
        del all_blocks, blocks
        split_kinds = (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
        acts = self.schedule.actions[self.rank]
        split = {a.stage for a in acts if a.kind in split_kinds}
        self.stages: dict[int, Stage] = {}
        for s in mine:
            module = nn.Sequential(
                OrderedDict((str(i), getattr(self.module, str(i))) for i in ranges[s])
            )
            self.stages[s] = Stage(
                s,
                self.schedule.n_stages,
                module,
                stage_gradients(module, split=s in split, label=f"rank {self.rank} stage {s}"),
                loss_fn,
                self.n_microbatches,
            )
        self._plan = plan_communication(self.schedule, self.rank)
        self._layouts: Layouts = {}
        self._forward_schedule: Schedule | None = None
        self._forward_plan: CommPlan | None = None
        self._spans: list[Span] = []
        self._peak_stashed_bytes = 0

    # -- training and evaluation ---------------------------------------------------

    def step(self, inputs: Batch | None, targets: Batch | None) -> float:
        """Run one training step: forward and backward of every micro-batch.

        Gradients are accumulated into ``.grad`` of this rank's parameters (call
        :meth:`zero_grad` between steps). Collective: every rank calls it.

        Args:
            inputs: the batch of model inputs; only the rank of stage 0 needs it
                (others may pass None).
            targets: the batch of targets; only the rank of the last stage
                needs it (others may pass None).

        Returns:
            The mean loss over the batch (mean of the micro-batch losses), on every rank.

        Raises:
            PipelineConfigError: if a needed batch is missing or does not split.
            ShapeMismatchError: if activations change shape after the first step.
            PeerError: if a peer fails or times out.
        """
        try:
            result = self._run(self.schedule, self._plan, self._layouts, inputs, targets)
        except BaseException:
            for stage in self.stages.values():
                stage.abandon_step()
            raise
        for stage in self.stages.values():
            stage.finish_step()
        loss = self._share_loss(result)
        assert loss is not None
        return loss

    @torch.no_grad()
    def eval_step(self, inputs: Batch | None, targets: Batch | None = None) -> Any:
        """Forward only, without autograd. Collective: every rank calls it.

        Args:
            inputs: the batch (needed on the rank of stage 0).
            targets: the targets (needed on the rank of the last stage); None for outputs.

        Returns:
            With targets: the mean loss, on every rank. Without: on the rank of
            the last stage, the output batch (micro-batch outputs concatenated);
            None on the other ranks.
        """
        if self._forward_plan is None:
            self._forward_schedule = forward_only(self.schedule)
            self._forward_plan = plan_communication(self._forward_schedule, self.rank)
        assert self._forward_schedule is not None
        # Shapes may differ from training (no gradient flags, other batch size):
        # exchange layouts afresh each call.
        result = self._run(self._forward_schedule, self._forward_plan, {}, inputs, targets)
        loss = self._share_loss(result)
        if loss is not None:
            return loss
        if not result.outputs:
            return None
        parts = [unflatten(*result.outputs[m]) for m in range(self.n_microbatches)]
        return concat_microbatches(parts)

    def _run(
        self,
        schedule: Schedule,
        plan: CommPlan,
        layouts: Layouts,
        inputs: Batch | None,
        targets: Batch | None,
    ) -> StepResult:
        last = self.schedule.n_stages - 1
        mb_inputs = self._split(inputs, "inputs") if 0 in self.stages else None
        mb_targets = self._split(targets, "targets") if last in self.stages else None
        collective.barrier(self.world, self.timeout, "at the start of the step")
        clock = StepClock(self.device)
        channel = None
        if plan.peers:
            channel = StepChannel(
                plan,
                self.world,
                self.device,
                layouts,
                self.timeout,
                schedule.n_stages,
                self.n_microbatches,
            )
        run = StepRun(
            self.rank,
            schedule.placement,
            self.stages,
            channel,
            mb_inputs,
            mb_targets,
            clock,
            self._weight_group_size,
        )
        result = run.run(schedule.actions[self.rank])
        self._spans = result.spans
        self._peak_stashed_bytes = result.peak_stashed_bytes
        return result

    def _split(self, batch: Batch | None, what: str) -> list[Batch] | None:
        if batch is None:
            if what == "targets":
                return None
            raise PipelineConfigError(
                f"rank {self.rank} holds stage 0 and needs the inputs, but got None"
            )
        return split_batch(to_device(batch, self.device), self.n_microbatches, what)

    def _share_loss(self, result: StepResult) -> float | None:
        """The mean loss from the last stage's rank, on every rank (None: no targets)."""
        last_rank = self.schedule.rank_of(self.schedule.n_stages - 1)
        message = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.rank == last_rank and result.losses:
            losses = [result.losses[m].double() for m in range(self.n_microbatches)]
            message[0] = 1.0
            message[1] = torch.stack(losses).sum() / self.n_microbatches
        collective.broadcast(self.world, message, last_rank, self.timeout, "the step's loss")
        return float(message[1]) if bool(message[0]) else None

    # -- parameters, state, gradients --------------------------------------------------

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in ``nn.Sequential(*blocks)`` (``3.attn.q.weight``)."""
        return self.module.named_parameters(prefix)

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """This rank's buffers, named like :meth:`named_parameters`."""
        return self.module.named_buffers(prefix)

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers, named as in ``nn.Sequential(*blocks)``."""
        return dict(self.module.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's entries of a state dict of the whole model (or of this rank).

        Entries of blocks on other ranks are ignored, so every rank can load
        the same single-process ``state_dict``.

        Args:
            state_dict: names as in ``nn.Sequential(*blocks).state_dict()``.
            strict: raise if an entry of a local block is missing or unknown.

        Returns:
            torch's ``(missing_keys, unexpected_keys)`` for the local blocks.

        Raises:
            RuntimeError: with ``strict``, on missing or unexpected local keys.
        """
        local_blocks = {name for name, _ in self.module.named_children()}
        own = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in local_blocks}
        unknown = [k for k in state_dict if not k.split(".", 1)[0].isdigit()]
        result = self.module.load_state_dict(own, strict=False)
        result.unexpected_keys.extend(unknown)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"rank {self.rank}: error loading the state dict: missing keys "
                f"{result.missing_keys}, unexpected keys {result.unexpected_keys}"
            )
        return result

    def train(self, mode: bool = True) -> Pipeline:
        """Set training mode of the local blocks (dropout, batch norm)."""
        self.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        """Set evaluation mode of the local blocks."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters."""
        self.module.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of the whole model by their global norm (over all ranks).

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the single-process model.
        Collective: every rank calls it.

        Returns:
            The global norm of all gradients before clipping (a 0-dim tensor).
        """
        return clip_grad_norm_(
            self.parameters(), max_norm, norm_type, self.world, self.device, self.timeout
        )

    # -- timing ------------------------------------------------------------------------

    def peak_stashed_bytes(self) -> int:
        """The most bytes this rank's 2BP engine kept for W at once in the last step.

        Sampled after every ``I``; 0 without 2BP.
        """
        return self._peak_stashed_bytes

    @property
    def local_spans(self) -> list[Span]:
        """The compute spans of this rank in the last step (seconds from its start)."""
        return list(self._spans)

    def timeline(self) -> list[Span]:
        """The last step's compute spans of every rank, merged. Collective.

        Times are seconds from the step start, which a barrier aligns across ranks.
        """
        mine = [(s.rank, str(s.action), s.start, s.end) for s in self._spans]
        merged = [
            Span(r, Action.parse(a), start, end)
            for spans in collective.all_gather_objects(self.world, mine)
            for r, a, start, end in spans
        ]
        return sorted(merged, key=lambda s: (s.rank, s.start))
