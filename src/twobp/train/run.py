"""Start a training run: local ranks of our own, or the ranks ``torchrun`` started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from twobp.runtime import launch
from twobp.runtime.setup.group import launched_by_env
from twobp.train.checkpointing import check_resume
from twobp.train.config import TrainConfig
from twobp.train.loop import RankResult, StepHook, train_rank
from twobp.train.report import write_report


def run_training(cfg: TrainConfig, on_step: StepHook | None = None) -> dict[str, Any] | None:
    """Train as ``cfg`` says and write the report.

    Under ``torchrun`` this process is one rank: the results are gathered to
    rank 0, which writes the report and returns the summary (other ranks
    return None). Otherwise ``cfg.ranks`` local processes are started.

    Args:
        cfg: the run's options.
        on_step: called on every rank with ``(rank, step)`` before each step
            (a picklable module-level function when local ranks are started).

    Raises:
        twobp.runtime.LaunchError: if a local rank failed (it names the rank).
        ValueError: on options that do not fit together.
    """
    check_config(cfg)
    out = Path(cfg.out)
    if launched_by_env() or dist.is_initialized():
        mine = train_rank(cfg, on_step)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return None
        return write_report(cfg, _by_rank(gathered), out)
    results = launch(
        train_rank,
        cfg.ranks,
        cfg,
        on_step,
        threads_per_rank=cfg.threads,
        group_timeout=cfg.timeout,
    )
    return write_report(cfg, _by_rank(results), out)


def _by_rank(results: list[Any]) -> list[RankResult]:
    return sorted((r for r in results if r is not None), key=lambda r: r.rank)


def check_config(cfg: TrainConfig) -> None:
    """Reject option combinations before any process starts.

    Raises:
        ValueError: naming the option and what to change.
    """
    if cfg.ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {cfg.ranks}")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {cfg.microbatches}")
    if cfg.batch_size % cfg.microbatches:
        raise ValueError(
            f"--batch-size {cfg.batch_size} does not divide into {cfg.microbatches} "
            f"micro-batches; pick a batch size that is a multiple of --microbatches"
        )
    if cfg.save_every < 0:
        raise ValueError(f"--save-every must be >= 0, got {cfg.save_every}")
    if cfg.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    if cfg.stop_after is not None and cfg.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1, got {cfg.stop_after}")
    check_resume(cfg)
