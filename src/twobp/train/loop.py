"""The per-rank training loop of ``twobp train``."""

from __future__ import annotations

import dataclasses
import math
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from twobp.runtime import Pipeline, PipelineOptions
from twobp.runtime.communication.collective import all_gather_objects
from twobp.runtime.errors import NonFiniteLossError
from twobp.runtime.execution.microbatch import Batch, split_batch
from twobp.timeline import Span, bubble_ratio
from twobp.train import checkpointing
from twobp.train.config import TrainConfig, parse_partition, tensor_sizes
from twobp.train.console import ConsoleStream
from twobp.train.engine_summary import EngineSummary, rank_summary
from twobp.train.metrics import MetricsLog, StepMetrics
from twobp.train.progress import Progress
from twobp.train.skipped import SkipNotes
from twobp.train.stopping import StopSignals, agree_to_stop
from twobp.train.task import Task, autocast_dtype, build_task, grad_scaler
from twobp.train.what_ran import resumed_split_text, what_ran

# Steps left out of the throughput figure: the first steps agree tensor shapes
# and warm up the allocator and kernels.
WARMUP_STEPS = 2
# With --nonfinite skip, this many skipped steps in a row end the run: the
# weights themselves are then most likely broken, and skipping wastes the job.
MAX_SKIPPED_IN_A_ROW = 10


@dataclass
class RankResult:
    """What one rank hands back to the launcher for the report."""

    rank: int
    losses: list[float] = field(default_factory=list)
    """Mean loss of every step (the same on every rank)."""
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of every step on this rank, optimizer included."""
    eval_loss: float = math.nan
    """Mean loss of one held-out batch after training (in ``eval()`` mode)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """``(step, held-out loss)`` at every record of this run (``--log-every``), in ``eval()``
    mode, and after the last step."""
    peak_rss_bytes: int = 0
    """Peak resident memory of this rank's process."""
    peak_stashed_bytes: int = 0
    """Peak bytes the 2BP engine held for deferred weight gradients on this rank."""
    engine: EngineSummary = field(default_factory=EngineSummary)
    """What the 2BP engine deferred on this rank's split stages."""
    memory: dict[str, int] = field(default_factory=dict)
    """The largest of each ``Pipeline.memory_stats`` figure over the steps of this run."""
    spans: list[Span] = field(default_factory=list)
    """Timeline of the last step, all ranks merged (filled on rank 0)."""
    waits: list[Span] = field(default_factory=list)
    """Where the ranks waited on peers in the last step (``Pipeline.timeline(waits=True)``
    less :attr:`spans`; filled on rank 0)."""
    stage_blocks: list[list[int]] = field(default_factory=list)
    """Block indices of every stage."""
    placement: list[int] = field(default_factory=list)
    """The rank of every stage."""
    schedule_text: str = ""
    """The schedule that ran, as text."""
    data_source: str = ""
    tokens_per_sample: float | None = None
    """Tokens in one sample (None for images)."""
    n_parameters: int = 0
    """Parameters held by this rank."""
    precision: str = ""
    """The dtypes the pipeline ran in: ``"float32"``, or ``"bfloat16 autocast, float32
    parameters"``."""
    resumed_from: int | None = None
    """The step the run continued from (None: a fresh start)."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose loss was not finite and whose gradients were dropped (``--nonfinite skip``)."""
    overflow_steps: list[int] = field(default_factory=list)
    """Steps the loss scaler skipped on every rank: a gradient overflowed float16."""
    loss_scale: str | None = None
    """The loss scaling: ``"dynamic"`` or ``"static"``; None: none."""
    loss_scale_state: dict[str, Any] = field(default_factory=dict)
    """The loss scaler's state at the end (``GradScaler.state_dict()``; empty without one)."""
    save_seconds: list[float] = field(default_factory=list)
    """Wall time of every checkpoint this run wrote."""
    checkpoint: str = ""
    """The last checkpoint this run wrote ("" if none)."""
    interrupted: bool = False
    """The run stopped early on a signal (at the same step on every rank)."""
    stages: list[tuple[int, int, int]] = field(default_factory=list)
    """``(stage, first block, last block)`` of every stage this rank runs (a data-parallel
    copy's rank: its copy's; -1 for a stage without blocks)."""
    ran: dict[str, Any] = field(default_factory=dict)
    """What ran: the schedule (``auto``'s choice and why), copies, recompute, precision,
    scaler (see :mod:`twobp.train.what_ran`)."""
    compile_choice: dict[int, str | None] = field(default_factory=dict)
    """With ``--compile``: how each of this rank's stages ran its blocks at the end
    (``Pipeline.compile_choice``)."""
    bubbles: list[float] = field(default_factory=list)
    """The measured bubble ratio of every recorded step (rank 0; the mean over ranks)."""
    bubbles_per_rank: list[dict[int, float]] = field(default_factory=list)
    """Each rank's measured bubble ratio at every recorded step (rank 0)."""
    step_times: dict[str, float] = field(default_factory=dict)
    """``Pipeline.step_times`` summed over this run's steps, and ``steps``: how many."""


StepHook = Callable[[int, int], None]
"""``hook(rank, step)``, called before each step (tests use it to inject failures)."""


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to a tenth of it."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def train_rank(
    cfg: TrainConfig,
    on_step: StepHook | None = None,
    progress_stream: TextIO | None = None,
    stop_signals: Sequence[int] = (signal.SIGINT, signal.SIGHUP),
) -> RankResult:
    """Train on this rank of the current process group; returns its figures.

    Resumes from ``cfg.resume`` if given, and saves checkpoints as ``cfg`` says.
    The first of ``stop_signals`` that reaches any rank ends the run after the
    step in flight, on every rank, with a checkpoint (``result.interrupted``);
    a second one raises ``KeyboardInterrupt`` (see :mod:`twobp.train.stopping`).

    Args:
        cfg: the run's options.
        on_step: called with ``(rank, step)`` before each step.
        progress_stream: where rank 0 writes its progress (default: stderr);
            once its reader is gone (a closed pipe, a terminal that hung up),
            nothing more is written there and the run goes on.
        stop_signals: the signals that stop the run. Local ranks leave SIGTERM
            to the launcher, which terminates a stuck rank with it.
    """
    console = ConsoleStream(progress_stream or sys.stderr)
    with StopSignals(stop_signals) as stop:
        return _train_rank(cfg, on_step, console, stop)


def _tensor_parallel_plan(cfg: TrainConfig) -> dict[str, str] | None:
    """The tensor-parallel plan of the run's model (None without tensor parallelism)."""
    if max(tensor_sizes(cfg)) == 1:
        return None
    if cfg.hf_config is not None:
        from twobp.integrations.transformers import build_model as build_hf
        from twobp.integrations.transformers import tensor_parallel_plan as hf_plan

        return hf_plan(build_hf(cfg.hf_config, cfg.size), vocabulary=False)
    from twobp.models import tensor_parallel_plan

    return tensor_parallel_plan(cfg.model)


def _tensor_parallel(cfg: TrainConfig) -> int | tuple[int, ...] | None:
    """The pipeline's ``tensor_parallel``: the run's size (None for 1), or its sizes."""
    sizes = tensor_sizes(cfg)
    if len(sizes) > 1:
        return tuple(sizes)
    return sizes[0] if sizes[0] > 1 else None


def pipeline_options(cfg: TrainConfig, resumed_split: list[bool] | None = None) -> PipelineOptions:
    """The pipeline's options of a run: its config's, and the 2BP stages a resumed run's
    checkpoint chose (``two_bp`` unset), if any."""
    return PipelineOptions(
        schedule=cfg.schedule,
        n_microbatches=cfg.microbatches,
        two_bp=cfg.two_bp if resumed_split is None else resumed_split,
        partition=parse_partition(cfg.partition),
        two_bp_policy=cfg.policy,
        stages_per_rank=cfg.stages_per_rank,
        timeout=cfg.timeout,
        num_threads=cfg.threads,
        nonfinite=cfg.nonfinite,
        recompute=cfg.recompute,
        weight_group_size=cfg.weight_group_size,
        autocast=autocast_dtype(cfg),
        data_parallel=cfg.data_parallel,
        shard_parameters=cfg.shard_parameters,
        scatter_each_w=cfg.scatter_each_w,
        tensor_parallel=_tensor_parallel(cfg),
        tensor_parallel_plan=_tensor_parallel_plan(cfg),
        memory_limit=cfg.memory_limit,
        # AdamW's two float32 moments per parameter, sharded with --shard-optimizer.
        optimizer_state_bytes=8.0,
        optimizer_sharded=cfg.shard_optimizer or cfg.shard_parameters,
        auto_trials=cfg.auto_trials,
        compile=cfg.compile,
    )


def _train_rank(
    cfg: TrainConfig, on_step: StepHook | None, progress_stream: ConsoleStream, stop: StopSignals
) -> RankResult:
    task = build_task(cfg)
    scaler = grad_scaler(cfg)
    # A resume runs the 2BP stages its checkpoint's run chose (two_bp unset), if any.
    resumed_split = checkpointing.resumed_split(
        cfg, dist.get_world_size() if dist.is_initialized() else 1
    )
    pipe = Pipeline(
        task.spec.blocks,
        task.spec.loss_fn,
        options=pipeline_options(cfg, resumed_split),
        # The first micro-batch: what a balanced partition, the default two_bp and auto
        # profile the blocks on.
        # (None with one tensor-parallel size: each shard's pipeline would profile apart; a
        # range of sizes is chosen on it.)
        example_input=(
            task.batch_at(0, "train")[0][: cfg.batch_size // cfg.data_parallel // cfg.microbatches]
            if isinstance(cfg.microbatches, int) and not isinstance(_tensor_parallel(cfg), int)
            else None
        ),
        grad_scaler=scaler,
    )
    if not isinstance(cfg.microbatches, int):
        # The count is chosen for the batch: plan on the first one (copy 0's part) now,
        # before the stages are reported and a checkpoint is loaded into them.
        first = split_batch(task.batch_at(0, "train")[0], cfg.data_parallel, "inputs")[0]
        pipe.plan_on(first)
    if pipe.plan is not None and _leads(pipe):
        print(pipe.plan, file=progress_stream or sys.stderr)
    if pipe.two_bp_choice is not None and _leads(pipe):
        print(pipe.two_bp_choice.summary(), file=progress_stream or sys.stderr)
    if pipe.rebuild_choice is not None and _leads(pipe):
        print(pipe.rebuild_choice.summary(), file=progress_stream or sys.stderr)
    if resumed_split is not None and _leads(pipe):
        print(resumed_split_text(resumed_split), file=progress_stream or sys.stderr)
    result = RankResult(
        rank=pipe.rank,
        stage_blocks=[list(r) for r in pipe.stage_blocks],
        placement=list(pipe.schedule.placement),
        schedule_text=str(pipe.schedule),
        data_source=task.data_source,
        tokens_per_sample=task.tokens_per_sample,
        n_parameters=sum(p.numel() for p in pipe.state.parameters()),
        precision=_precision(pipe),
        stages=_stages(pipe),
    )
    result.ran = what_ran(pipe, cfg, result.precision)
    if cfg.shard_optimizer or cfg.shard_parameters:
        optimizer = pipe.shard_optimizer(
            torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    history = checkpointing.resume(pipe, optimizer, cfg)
    if history.step:
        result.resumed_from = history.step
    if scaler is not None:
        static = scaler.get_growth_factor() == 1.0 and scaler.get_backoff_factor() == 1.0
        result.loss_scale = "static" if static else "dynamic"
        if static:
            # A checkpoint restores its scale; a static --loss-scale is the scale asked for.
            configured = grad_scaler(cfg)
            assert configured is not None
            scaler.load_state_dict(configured.state_dict())
    # The same lists: what the loop appends is in the next checkpoint's history.
    result.losses, result.skipped_steps = history.losses, history.skipped_steps
    result.overflow_steps = history.overflow_steps
    progress, metrics = _reporters(0 if _leads(pipe) else 1, cfg, progress_stream, history.step)
    if progress is not None and cfg.compile:
        # torch.compile builds each stage's graphs in the first step: a minute, silent.
        for s in range(pipe.schedule.n_stages):
            progress.note(f"compiling stage {s} ...")
    try:
        _train_steps(pipe, optimizer, task, cfg, history, result, on_step, progress, metrics, stop)
    finally:
        if progress is not None and metrics is not None:
            progress.close()
            metrics.close()
    if scaler is not None:
        result.loss_scale_state = scaler.state_dict()
    result.engine = rank_summary(pipe.stages.values())
    spans = pipe.timeline()
    shown = set(spans)
    waits = [s for s in pipe.timeline(waits=True) if s not in shown]
    if _leads(pipe):
        result.spans, result.waits = spans, waits
    result.eval_loss = held_out_loss(pipe, task)
    if not result.eval_losses or result.eval_losses[-1][0] != history.step:
        result.eval_losses.append((history.step, result.eval_loss))
    result.peak_rss_bytes = _peak_rss_bytes()
    result.compile_choice = pipe.compile_choice
    return result


def _stages(pipe: Pipeline) -> list[tuple[int, int, int]]:
    """``(stage, first block, last block)`` of this rank's stages."""
    out = []
    for s in sorted(pipe.stages):
        blocks = pipe.stage_blocks[pipe.schedule.model_stage(s)]
        out.append((s, blocks[0], blocks[-1]) if len(blocks) else (s, -1, -1))
    return out


def held_out_loss(pipe: Pipeline, task: Task) -> float:
    """The mean loss of the held-out batch, in ``eval()`` mode (dropout off, BatchNorm's
    running statistics), then back to the mode the pipeline was in. Collective."""
    inputs, targets = own_part(pipe, task.batch_at(0, "eval"))
    training = pipe.module.training
    pipe.eval()
    try:
        return float(pipe.eval_step(inputs, targets))
    finally:
        pipe.train(training)


def _add_step_times(total: dict[str, float], pipe: Pipeline) -> None:
    """Add the last step's ``Pipeline.step_times`` to ``total``."""
    for name, value in dataclasses.asdict(pipe.step_times).items():
        total[name] = total.get(name, 0.0) + value
    total["steps"] = total.get("steps", 0.0) + 1


def _precision(pipe: Pipeline) -> str:
    """The dtypes the pipeline runs in, as the report says them."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in pipe.state.parameters()})
    parameters = ", ".join(dtypes) or "no parameters"
    if pipe.autocast is None:
        return parameters
    return f"{str(pipe.autocast).removeprefix('torch.')} autocast, {parameters} parameters"


def _leads(pipe: Pipeline) -> bool:
    """True on the one rank that reports: pipeline rank 0 of the first copy's first shard
    (with tensor parallelism each shard's pipeline has a rank 0)."""
    return pipe.rank == 0 and pipe.tp_rank == 0


def _reporters(
    rank: int, cfg: TrainConfig, stream: ConsoleStream, initial: int
) -> tuple[Progress | None, MetricsLog | None]:
    """Rank 0's progress display and metrics files (None on other ranks)."""
    if rank != 0:
        return None, None
    progress = Progress(
        cfg.steps, cfg.log_every, stream, initial=initial, out=Path(cfg.out), warmup=WARMUP_STEPS
    )
    metrics = MetricsLog(Path(cfg.out), resumed_from=initial)
    if metrics.tensorboard_missing:
        print(
            f"tensorboard is not installed: metrics go to {metrics.path} only "
            "(pip install 'twobp[tensorboard]' for TensorBoard event files)",
            file=progress.stream,
        )
    return progress, metrics


def _train_steps(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    task: Task,
    cfg: TrainConfig,
    history: checkpointing.History,
    result: RankResult,
    on_step: StepHook | None,
    progress: Progress | None,
    metrics: MetricsLog | None,
    stop: StopSignals,
) -> None:
    """Run the steps from ``history.step`` to the run's last, saving as ``cfg`` says.

    After every step's backward the ranks agree whether one of them was asked to
    stop; if so, they finish that step, log it, save it and end. Rank 0 tells of skipped
    steps as they happen (see :mod:`twobp.train.skipped`).
    """
    logged = len(result.step_seconds)  # steps of this run before the last record
    end = checkpointing.last_step(cfg)
    skip_notes = SkipNotes(cfg.steps, cfg.log_every)
    for step in range(history.step, end):
        if on_step is not None:
            on_step(pipe.rank, step)
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = own_part(pipe, task.batch_at(step, "train"))
        grad_norm: float | None = None
        start = time.perf_counter()
        loss = float(pipe.step(inputs, targets))
        # Agreed before the step is logged: the step a stop ends on gets its record.
        stopping = agree_to_stop(pipe.topology.members, pipe.device, cfg.timeout, stop.requested)
        log_due = (step + 1) % cfg.log_every == 0 or step + 1 == end or stopping
        scaler = pipe.grad_scaler
        skip_note: str | None = None
        if pipe.last_step_skipped:
            result.skipped_steps.append(step)
            skip_note = skip_notes.nonfinite(step + 1, loss)
            _check_skipped_in_a_row(result.skipped_steps, pipe.rank)
        else:
            if scaler is not None:
                # Collective: every rank learns whether any gradient overflowed.
                scaler.unscale_(optimizer)
            if cfg.grad_clip > 0:
                grad_norm = float(pipe.clip_grad_norm_(cfg.grad_clip))
            elif log_due:
                # An infinite limit scales by exactly 1: the norm, with the gradients unchanged.
                grad_norm = float(pipe.clip_grad_norm_(math.inf))
            if scaler is None:
                optimizer.step()
            else:
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                if scaler.last_step_skipped:
                    result.overflow_steps.append(step)
                    grad_norm = None
                    static = scaler.get_backoff_factor() == 1.0
                    skip_note = skip_notes.overflow(step + 1, scale, scaler.get_scale(), static)
        pipe.zero_grad()
        result.step_seconds.append(time.perf_counter() - start)
        _add_step_times(result.step_times, pipe)
        result.losses.append(loss)
        result.peak_stashed_bytes = max(result.peak_stashed_bytes, pipe.peak_stashed_bytes())
        for name, value in pipe.memory_stats(optimizer).items():
            result.memory[name] = max(result.memory.get(name, 0), value)
        history.step = step + 1
        samples = _samples_per_s(result.step_seconds, logged, cfg.batch_size)
        tokens = None if task.tokens_per_sample is None else samples * task.tokens_per_sample
        if log_due:
            # Collective: every rank's spans and memory.
            record = _step_metrics(pipe, result, history.step, loss, lr, grad_norm, samples, tokens)
            logged = len(result.step_seconds)
            if metrics is not None:
                metrics.write(record)
        if progress is not None:
            progress.update(step + 1, loss, samples, tokens)
            if skip_note is not None:
                progress.note(skip_note)
        if log_due and not stopping and history.step < end:
            # After the last step, train_rank evaluates once its timeline is taken.
            result.eval_losses.append((history.step, held_out_loss(pipe, task)))
        if stopping and progress is not None:
            saving = "saving a checkpoint" if cfg.save else "not saving (--no-save)"
            progress.note(f"stopping after step {history.step}, as asked; {saving}")
        if checkpointing.save_due(cfg, history.step) or (stopping and cfg.save):
            start = time.perf_counter()
            saved = checkpointing.save(pipe, optimizer, cfg, history, last=stopping)
            result.checkpoint = str(saved)
            result.save_seconds.append(time.perf_counter() - start)
        if stopping:
            result.interrupted = history.step < end
            break


def _samples_per_s(step_seconds: list[float], since: int, batch_size: int) -> float:
    """Samples per second over this run's steps from index ``since`` on.

    The first :data:`WARMUP_STEPS` of the run are left out while later steps exist.
    """
    window = step_seconds[max(since, WARMUP_STEPS) :] or step_seconds[since:] or step_seconds[-1:]
    return batch_size * len(window) / sum(window)


def _step_metrics(
    pipe: Pipeline,
    result: RankResult,
    step: int,
    loss: float,
    lr: float,
    grad_norm: float | None,
    samples_per_s: float,
    tokens_per_s: float | None,
) -> StepMetrics:
    """The record of the step just done. Collective: gathers every rank's spans and memory."""
    spans = pipe.timeline()
    device_peak = (
        torch.cuda.max_memory_allocated(pipe.device) if pipe.device.type == "cuda" else None
    )
    mine = (_peak_rss_bytes(), result.peak_stashed_bytes, device_peak)
    every = all_gather_objects(pipe.topology.members, mine)
    if _leads(pipe) and spans:
        result.bubbles.append(bubble_ratio(spans))
        ranks = sorted({s.rank for s in spans})
        result.bubbles_per_rank.append({r: bubble_ratio(spans, r) for r in ranks})
    return StepMetrics(
        step=step,
        loss=loss,
        lr=lr,
        grad_norm=grad_norm,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        bubble=bubble_ratio(spans),
        step_seconds=result.step_seconds[-1],
        peak_rss_bytes=[rss for rss, _, _ in every],
        peak_stash_bytes=[stash for _, stash, _ in every],
        peak_device_bytes=None if device_peak is None else [d for _, _, d in every],
    )


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _check_skipped_in_a_row(skipped: list[int], rank: int) -> None:
    """Raise once the last :data:`MAX_SKIPPED_IN_A_ROW` steps were all skipped.

    Every rank knows the same skipped steps, so every rank raises.

    Raises:
        NonFiniteLossError: naming the steps.
    """
    recent = skipped[-MAX_SKIPPED_IN_A_ROW:]
    if len(recent) == MAX_SKIPPED_IN_A_ROW and recent[-1] - recent[0] == len(recent) - 1:
        raise NonFiniteLossError(
            f"rank {rank}: the loss was not finite in {len(recent)} steps in a row "
            f"({recent[0]} to {recent[-1]}); the weights are probably broken. Resume from an "
            "earlier checkpoint with a lower --lr (or more --warmup, --grad-clip)",
            recent[-1],
            math.nan,
        )


def own_part(pipe: Pipeline, batch: tuple[Batch, Batch]) -> tuple[Batch, Batch]:
    """This data-parallel copy's part of a global batch (the whole of it without copies).

    Raises:
        PipelineConfigError: if the batch holds fewer samples than copies (a batch that
            does not divide gives copies whose sizes differ by one).
    """
    if pipe.dp_size == 1:
        return batch
    inputs = split_batch(batch[0], pipe.dp_size, "inputs")[pipe.dp_rank]
    targets = split_batch(batch[1], pipe.dp_size, "targets")[pipe.dp_rank]
    return inputs, targets
