"""One regime of the bench on one rank of the launched group.

Every rank builds the same model (same seed), the same batch for each
micro-batch count, and every variant from a copy of the same blocks with the
same partition. Then, for each micro-batch count:

1. build the variants; one that torch or twobp refuses on any rank is
   skipped on all of them, with the reason;
2. run the rounds: every variant once per round, in turn (A B C A B C ...);
   the first ``warmup`` rounds are not timed, and the last of them runs each
   step under the memory probe and sketches every parameter's gradient (the
   check that all variants compute the same gradients); after each timed round, every
   rank profiles the blocks for the simulator check; the timed steps of the
   variant ``--cprofile`` names run under cProfile;
3. free the variants before the next count.

All ranks run the same sequence of steps and collectives, so they stay in step.
"""

from __future__ import annotations

import copy
import cProfile
import gc
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.models import ModelSpec, build_model
from twobp.runtime import Pipeline
from twobp.runtime.base.group import default_device
from twobp.runtime.execution.microbatch import Batch, split_batch
from twobp.runtime.setup.auto.cost_measurement import stage_gradient_bytes
from twobp.schedule import Schedule
from twobp.sim.search import describe
from twobp.timeline import Span, bubble_ratio
from twobp_bench import baseline, matrix
from twobp_bench.config import BenchPlan, Regime
from twobp_bench.deepspeed_engine import DeepSpeedRunner, deepspeed_refusal
from twobp_bench.measure import barrier, peak_rss_bytes, step_peak_bytes, timed_step
from twobp_bench.profile import (
    BlockProfiler,
    RankProfile,
    boundary_bytes,
    measure_allreduce,
    measure_link,
)
from twobp_bench.references import ReferenceRunner
from twobp_bench.runner import StepRunner, gradient_sketch, parameter_bytes
from twobp_bench.torch_pipelining import TorchRunner, tie_refusal
from twobp_bench.twobp_runner import TwobpRunner

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class VariantRecord:
    """What one rank measured of one variant at one micro-batch count.

    Args:
        variant: the variant.
        n_microbatches: micro-batches per step.
        partition: blocks per stage.
        stage_ranks: the rank of each stage.
        skipped: why the variant did not run (None if it ran).
        step_seconds: the step time of each timed round.
        cpu_seconds: this rank's CPU time in the step, of each timed round.
        bubble_ratios: the measured bubble ratio of each timed round (twobp only).
        busy_seconds: compute time per rank, mean over the ranks, of each timed
            round (twobp only; the rest of the step is waiting).
        rank_bubble_ratios: per timed round, the bubble ratio of each rank
            (twobp and baseline only).
        peak_step_bytes: the memory probe's peak of the step on this rank.
        stashed_bytes: the most bytes the 2BP engine held for W on this rank.
        grad_sketch: a sketch of each of this rank's parameter gradients after
            one step (:func:`~twobp_bench.runner.gradient_sketch`), by name in
            the whole model.
        parameter_bytes: bytes of this rank's parameters.
        schedule: the compute schedule twobp ran (twobp only).
        action_seconds: the measured durations of the compute actions of the
            timed steps, by ``"stage:kind:micro-batches"`` (twobp and baseline only).
        run_actions: the actions of each rank in the order the last step ran
            them (twobp and baseline only; the runtime may fuse an ``I`` and
            ``W`` into ``B``).
        memory: ``Pipeline.memory_stats`` of this rank after the probed step
            (twobp only): activations, stash, parameters, optimizer, peak.
        send_seconds: per timed round, this rank's time per send to another
            rank (``Pipeline.step_times``; twobp only, rounds with sends).
        outside_seconds: per timed round, the step's time outside its schedule:
            the wall time less the end of the last action of any rank, timed
            from the step's opening all-reduce (splitting the batch, settling
            the loss; twobp only).
        chose: what ``auto`` chose: schedule, stages per rank, 2BP policy
            (:func:`twobp.sim.search.describe`; None for the other variants).
        update_seconds: per timed round, this rank's time in the optimizer
            update its step includes (DeepSpeed only: ``train_batch`` ends with one).
        cut_into: the micro-batches a torch schedule cut the batch into (torch only).
    """

    variant: matrix.Variant
    n_microbatches: int
    partition: tuple[int, ...]
    stage_ranks: tuple[int, ...]
    skipped: str | None = None
    step_seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    bubble_ratios: list[float] = field(default_factory=list)
    busy_seconds: list[float] = field(default_factory=list)
    rank_bubble_ratios: list[list[float]] = field(default_factory=list)
    peak_step_bytes: int | None = None
    stashed_bytes: int | None = None
    grad_sketch: dict[str, tuple[float, ...]] | None = None
    parameter_bytes: int = 0
    schedule: Schedule | None = None
    action_seconds: dict[str, list[float]] = field(default_factory=dict)
    run_actions: dict[int, list[str]] = field(default_factory=dict)
    memory: dict[str, int] | None = None
    send_seconds: list[float] = field(default_factory=list)
    outside_seconds: list[float] = field(default_factory=list)
    chose: str | None = None
    update_seconds: list[float] = field(default_factory=list)
    cut_into: int | None = None


@dataclass
class RankReport:
    """Everything one rank measured in one regime.

    Args:
        rank: this rank.
        regime: the regime.
        model_config: the model's config fields.
        block_kinds: the role of each block.
        records: one per variant and micro-batch count, in run order.
        profiles: per micro-batch count, the profile for the simulator check
            (empty if not asked).
        peak_rss_bytes: this process's peak resident size at the end.
        device: the device the rank ran on.
        threads: torch threads of the rank.
    """

    rank: int
    regime: Regime
    model_config: dict[str, Any]
    block_kinds: list[str]
    records: list[VariantRecord]
    profiles: dict[int, RankProfile]
    peak_rss_bytes: int
    device: str
    threads: int


def run_regime(plan: BenchPlan, regime: Regime) -> RankReport:
    """Measure one regime on this rank (the body of a launched rank). Collective.

    Args:
        plan: the bench plan.
        regime: the regime to measure.

    Returns:
        This rank's measurements.
    """
    torch.set_num_threads(plan.threads)
    if plan.baseline_path is not None and plan.baseline_path not in sys.path:
        sys.path.insert(0, plan.baseline_path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = default_device()
    spec = build_model(
        regime.family, plan.size, dtype=DTYPES[plan.dtype], seed=plan.seed, **dict(regime.overrides)
    )
    kinds = [k.value for k in spec.block_kinds]
    link = (0.0, float("inf"))
    reduce_bandwidth = float("inf")
    if plan.simulate:
        example = _batch(spec, regime, 1, plan.seed)[0]
        link = measure_link(boundary_bytes(spec.blocks, example), device)
        reduce_bandwidth = measure_allreduce(
            stage_gradient_bytes(spec.blocks, plan.n_ranks), device
        )
    records: list[VariantRecord] = []
    profiles: dict[int, RankProfile] = {}
    for m in plan.microbatch_counts:
        group, profiler = _run_group(plan, spec, regime, m, rank, device)
        records.extend(group)
        if profiler is not None:
            profiles[m] = profiler.result(link, reduce_bandwidth)
    return RankReport(
        rank=rank,
        regime=regime,
        model_config=dict(vars(spec.config)),
        block_kinds=kinds,
        records=records,
        profiles=profiles,
        peak_rss_bytes=peak_rss_bytes(),
        device=str(device),
        threads=torch.get_num_threads(),
    )


def _batch(spec: ModelSpec, regime: Regime, m: int, seed: int) -> tuple[Batch, Batch]:
    inputs, targets = spec.make_batch(regime.microbatch_size * m, seed)
    return inputs, targets


def _variants(plan: BenchPlan, regime: Regime) -> list[matrix.Variant]:
    return matrix.build_variants(
        plan.schedules,
        plan.torch_schedules,
        plan.policies,
        without_2bp=plan.without_2bp,
        references=regime.references if plan.references else (),
        baseline=plan.baseline is not None,
        recomputes=plan.recomputes,
        deepspeed_schedules=plan.deepspeed_schedules,
    )


def _run_group(
    plan: BenchPlan, spec: ModelSpec, regime: Regime, m: int, rank: int, device: torch.device
) -> tuple[list[VariantRecord], BlockProfiler | None]:
    # Each data-parallel copy (ranks d * p .. d * p + p - 1) has a batch of its own.
    inputs, targets = _batch(spec, regime, m, plan.seed + 7919 * (rank // plan.n_ranks))
    inputs = _to(inputs, device)
    targets = _to(targets, device)
    kinds = [k.value for k in spec.block_kinds]
    records: list[VariantRecord] = []
    runners: list[tuple[VariantRecord, StepRunner]] = []
    # With --share-model, this twobp's variants take turns on one copy.
    shared = copy.deepcopy(spec.blocks) if plan.share_model else None
    variants = [
        v
        for v in _variants(plan, regime)
        if not (plan.torch_by_default and matrix.torch_cannot_run(v, plan.n_ranks, m))
    ]
    variants += matrix.counts_beside_auto(variants, regime.microbatch_size * m, plan.n_ranks, m)
    for variant in variants:
        stage_ranks = matrix.placement(variant, plan.n_ranks)
        partition: tuple[int, ...] = ()  # auto chooses its own, once built
        if not matrix.is_auto(variant):
            partition = matrix.variant_partition(
                kinds, matrix.model_stages(variant, plan.n_ranks), plan.partition
            )
        record = VariantRecord(variant, m, partition, stage_ranks)
        runner: StepRunner | None = None
        reason = matrix.twobp_refusal(variant, plan.n_ranks, m)
        if reason is None and plan.data_parallel > 1 and variant.framework != matrix.TWOBP:
            reason = f"--data-parallel {plan.data_parallel} runs twobp's own pipelines only"
        if reason is None and variant.framework == matrix.TORCH:
            reason = tie_refusal(spec.blocks, partition, stage_ranks)
        if reason is None and variant.framework == matrix.DEEPSPEED:
            reason = deepspeed_refusal() or tie_refusal(
                spec.blocks, partition, stage_ranks, "DeepSpeed's PipelineEngine"
            )
        if reason is None:
            try:
                runner = _build(
                    plan, variant, spec, m, partition, inputs, targets, rank, device, shared
                )
            except ValueError as exc:  # torch's and twobp's refusals are ValueErrors
                reason = f"{type(exc).__name__}: {exc}"
        record.skipped = _agree(reason)
        records.append(record)
        if record.skipped is None and runner is not None:
            record.parameter_bytes = parameter_bytes(runner)
            if isinstance(runner, TorchRunner):
                record.cut_into = runner.n_microbatches
            # A baseline's schedule is of the baseline's classes, which the
            # process that gathers the records cannot import.
            if isinstance(runner, TwobpRunner) and variant.framework == matrix.TWOBP:
                record.schedule = runner.schedule
                if runner.pipe.plan is not None and matrix.is_auto(variant):
                    record.partition = tuple(runner.pipe.plan.partition)
                    record.stage_ranks = runner.schedule.placement
                    record.chose = describe(runner.pipe.plan.choice)
            runners.append((record, runner))
    profiler = None
    if plan.simulate and any(isinstance(r, TwobpRunner) for _, r in runners):
        profiler = BlockProfiler(spec.blocks, split_batch(inputs, m), device)
    cprofile = (
        cProfile.Profile() if any(r.variant.label == plan.cprofile for r, _ in runners) else None
    )
    for round_index, index in matrix.round_robin(len(runners), plan.warmup + plan.rounds):
        record, runner = runners[index]
        if round_index == plan.warmup - 1:
            _probe(record, runner, device)
            continue
        timed = round_index >= plan.warmup
        profiled = cprofile if timed and record.variant.label == plan.cprofile else None
        seconds, cpu = timed_step(runner, device, profiled)
        figures = runner.after_step()
        runner.zero_grad()
        if timed:
            record.step_seconds.append(seconds)
            record.cpu_seconds.append(cpu)
            if "update_s" in figures:
                record.update_seconds.append(figures["update_s"])
            if isinstance(runner, TwobpRunner):
                record.bubble_ratios.append(figures["bubble_ratio"])
                record.busy_seconds.append(figures["busy_s"])
                if figures.get("send_s", -1.0) >= 0:
                    record.send_seconds.append(figures["send_s"])
                if runner.last_spans:
                    last = max(s.end for s in runner.last_spans)
                    record.outside_seconds.append(max(0.0, seconds - last))
                _record_actions(record, runner.last_spans, plan.n_ranks)
            if profiler is not None and index == len(runners) - 1:
                # Once per timed round, under the load the round's steps saw.
                barrier()
                profiler.measure()
    if cprofile is not None:
        Path(plan.cprofile_dir).mkdir(parents=True, exist_ok=True)
        cprofile.dump_stats(f"{plan.cprofile_dir}/{regime.name}-m{m}-rank{rank}.prof")
    runners.clear()
    gc.collect()
    barrier()
    return records, profiler


def _record_actions(record: VariantRecord, spans: Sequence[Span], n_ranks: int) -> None:
    """Keep the step's action durations, the order each rank ran them in, each rank's bubble."""
    record.rank_bubble_ratios.append([bubble_ratio(spans, r) for r in range(n_ranks)])
    order: dict[int, list[str]] = {}
    for span in sorted(spans, key=lambda s: (s.rank, s.start)):
        action = span.action
        key = f"{action.stage}:{action.kind.value}:{len(action.microbatches)}"
        record.action_seconds.setdefault(key, []).append(span.duration)
        order.setdefault(span.rank, []).append(str(action))
    record.run_actions = order


def _probe(record: VariantRecord, runner: StepRunner, device: torch.device) -> None:
    """One untimed step under the memory probe, then the gradients' sketch and the stash."""
    barrier()
    record.peak_step_bytes = step_peak_bytes(runner.step, device)
    if runner.collective:
        barrier()
    record.grad_sketch = gradient_sketch(runner.named_parameters())
    figures = runner.after_step()
    if "stashed_bytes" in figures:
        record.stashed_bytes = int(figures["stashed_bytes"])
    if isinstance(runner, TwobpRunner) and record.variant.framework == matrix.TWOBP:
        record.memory = runner.pipe.memory_stats()
    runner.zero_grad()


def _build(
    plan: BenchPlan,
    variant: matrix.Variant,
    spec: ModelSpec,
    m: int,
    partition: tuple[int, ...],
    inputs: Batch,
    targets: Batch,
    rank: int,
    device: torch.device,
    shared: list[nn.Module] | None = None,
) -> StepRunner:
    # Only this twobp's variants take turns on the shared copy.
    blocks: list[nn.Module] = (
        shared
        if shared is not None and variant.framework == matrix.TWOBP
        else copy.deepcopy(spec.blocks)
    )
    share = blocks is shared
    if variant.framework in matrix.PIPELINES_OF_TWOBP:
        pipeline_class = Pipeline
        if variant.framework == matrix.BASELINE:
            pipeline_class = importlib.import_module(f"{baseline.PACKAGE}.runtime").Pipeline
        return TwobpRunner(
            variant,
            blocks,
            spec.loss_fn,
            m,
            partition,
            inputs,
            targets,
            device=device,
            threads=plan.threads,
            timeout=plan.timeout,
            pipeline_class=pipeline_class,
            data_parallel=plan.data_parallel,
            weight_group_size=plan.weight_group_size,
            shared=share,
        )
    peers: dict[str, type[TorchRunner] | type[DeepSpeedRunner]] = {
        matrix.TORCH: TorchRunner,
        matrix.DEEPSPEED: DeepSpeedRunner,
    }
    if variant.framework in peers:
        return peers[variant.framework](
            variant,
            blocks,
            spec.loss_fn,
            variant.microbatches or m,
            partition,
            inputs,
            targets,
            rank=rank,
            n_ranks=plan.n_ranks,
            device=device,
        )
    return ReferenceRunner(
        variant.schedule, blocks, spec.loss_fn, m, inputs, targets, device=device
    )


def _agree(reason: str | None) -> str | None:
    """The first rank's reason to skip, if any rank has one (every rank calls this)."""
    if not dist.is_initialized():
        return reason
    reasons: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    found: Sequence[tuple[int, str]] = [(r, x) for r, x in enumerate(reasons) if x is not None]
    if not found:
        return None
    r, text = found[0]
    return f"rank {r}: {text}"


def _to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, tuple):
        return tuple(t.to(device) for t in batch)
    return batch.to(device)
