"""A twobp :class:`~twobp.runtime.Pipeline` as a bench variant (of this twobp or the baseline's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from twobp.runtime import Pipeline
from twobp.runtime.execution.microbatch import Batch, split_batch
from twobp.runtime.execution.stage import LossFn
from twobp.schedule import Schedule
from twobp.timeline import Span, bubble_ratio, busy_time
from twobp_bench.matrix import AUTO, AUTO_MICROBATCHES, Variant, is_auto


class TwobpRunner:
    """A pipeline of twobp on this rank's share of the model.

    Args:
        variant: the twobp schedule, 2BP on or off, and the policy.
        blocks: the whole model's blocks (only this rank's are kept): a copy of its own,
            unless ``shared``.
        loss_fn: the model's loss (a mean over a micro-batch).
        n_microbatches: micro-batches per step.
        partition: blocks per stage (ignored by ``auto``, which chooses its own).
        inputs: the whole batch of model inputs (``auto`` profiles its first micro-batch).
        targets: the whole batch of targets.
        device: this rank's device.
        threads: torch threads of this rank.
        timeout: seconds to wait on a peer.
        pipeline_class: the ``Pipeline`` to build: this twobp's, or the
            baseline revision's (which takes the same arguments).
        data_parallel: copies of the pipeline (each rank passes its own copy's batch).
        weight_group_size: the cap on the micro-batches of one W (None: none).
        shared: ``blocks`` serve other pipelines too: this one claims them for each
            step and releases them after (and right after it is built).

    Raises:
        twobp.runtime.PipelineConfigError: if the schedule does not fit.
    """

    collective = True

    def __init__(
        self,
        variant: Variant,
        blocks: Sequence[nn.Module],
        loss_fn: LossFn,
        n_microbatches: int,
        partition: Sequence[int],
        inputs: Batch,
        targets: Batch,
        *,
        device: torch.device,
        threads: int,
        timeout: float,
        pipeline_class: Callable[..., Pipeline] = Pipeline,
        data_parallel: int = 1,
        weight_group_size: int | None = None,
        shared: bool = False,
    ) -> None:
        # Only when set: a baseline revision may not know the option.
        options: dict[str, object] = {}
        if data_parallel != 1:
            options["data_parallel"] = data_parallel
        if variant.recompute is not None:
            options["recompute"] = variant.recompute
        if weight_group_size is not None and variant.two_bp:
            options["weight_group_size"] = weight_group_size
        chosen_count = variant.schedule == AUTO_MICROBATCHES
        if chosen_count:
            # It plans on the batch: the micro-batch count too.
            options["n_microbatches"] = "auto"
        elif is_auto(variant):
            # It profiles the blocks on one micro-batch and chooses the rest.
            options["example_input"] = split_batch(inputs, n_microbatches)[0]
        else:
            options["two_bp"] = variant.two_bp
            options["partition"] = list(partition)
            options["two_bp_policy"] = variant.policy or "paper"
        self.pipe = pipeline_class(
            list(blocks),
            loss_fn,
            schedule=AUTO if chosen_count else variant.schedule,
            **{"n_microbatches": n_microbatches, **options},
            device=device,
            timeout=timeout,
            num_threads=threads,
        )
        if chosen_count:
            self.pipe.plan_on(inputs)
        self._shared = shared
        if shared:
            self.pipe.release_blocks()
        self.last_spans: list[Span] = []
        """The compute spans of every rank in the last step (after :meth:`after_step`)."""
        # Only the ranks of the first and last stage need the batch, as a user would pass it.
        needs_inputs, needs_targets = _ends(self.pipe)
        self._inputs = inputs if needs_inputs else None
        self._targets = targets if needs_targets else None

    @property
    def schedule(self) -> Schedule:
        """The compute schedule the pipeline runs."""
        return self.pipe.schedule

    def step(self) -> None:
        if not self._shared:
            self.pipe.step(self._inputs, self._targets)
            return
        self.pipe.claim_blocks()
        try:
            self.pipe.step(self._inputs, self._targets)
        finally:
            self.pipe.release_blocks()

    def zero_grad(self) -> None:
        self.pipe.zero_grad()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.pipe.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.pipe.named_parameters())

    def after_step(self) -> dict[str, float]:
        """Bubble ratio and compute time (means over ranks), bytes held for W, and this
        rank's time per send to another rank (-1 without sends). Collective."""
        # This copy's ranks, numbered as the schedule's ranks (the same with one copy).
        rows = self.pipe.topology.pipeline_ranks
        spans = [
            Span(rows.index(s.rank), s.action, s.start, s.end)
            for s in self.pipe.timeline()
            if s.rank in rows
        ]
        self.last_spans = spans
        ranks = sorted({s.rank for s in spans})
        busy = sum(busy_time(spans, r) for r in ranks) / max(1, len(ranks))
        # A baseline revision's pipeline may not tell its step's times.
        times = getattr(self.pipe, "step_times", None)
        per_send = times.sending / times.sends if times is not None and times.sends else -1.0
        return {
            "bubble_ratio": bubble_ratio(spans),
            "busy_s": busy,
            "stashed_bytes": float(self.pipe.peak_stashed_bytes()),
            "send_s": per_send,
        }


def _ends(pipe: Pipeline) -> tuple[bool, bool]:
    """Whether this rank needs the inputs and the targets.

    A baseline revision's pipeline may not say (it predates
    ``needs_inputs``): it has one pipeline, whose first and last stage do.
    """
    if hasattr(pipe, "needs_inputs"):
        return pipe.needs_inputs, pipe.needs_targets
    return 0 in pipe.stages, pipe.schedule.n_stages - 1 in pipe.stages
