"""Start a training run: local ranks of our own, or the ranks ``torchrun`` started."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from twobp.runtime import LaunchError, launch
from twobp.runtime.setup.group import launched_by_env
from twobp.train.config import TrainConfig
from twobp.train.failures import ERROR_LOG, RANK_LOGS, send_stderr_to, write_error_log
from twobp.train.loop import RankResult, StepHook, train_rank
from twobp.train.preflight import check_config
from twobp.train.report import write_config, write_report


def run_training(cfg: TrainConfig, on_step: StepHook | None = None) -> dict[str, Any] | None:
    """Train as ``cfg`` says; write its options (``OUT/config.toml``) first, the report last.

    Under ``torchrun`` this process is one rank: the results are gathered to
    rank 0, which writes the report and returns the summary (other ranks
    return None). Otherwise ``cfg.ranks`` local processes are started; unless
    ``cfg.verbose``, their stderr goes to ``OUT/logs/rank<N>.log``, and if
    any fails, every failed rank's traceback goes to ``OUT/errors.log`` (see
    :mod:`twobp.train.failures`).

    Args:
        cfg: the run's options.
        on_step: called on every rank with ``(rank, step)`` before each step
            (a picklable module-level function when local ranks are started).

    Raises:
        twobp.runtime.LaunchError: if a local rank failed (it names the rank).
        twobp.train.preflight.OptionError: on options that cannot work (before
            any rank starts).
    """
    if dist.is_initialized():
        n_ranks = dist.get_world_size()
    elif launched_by_env():
        n_ranks = int(os.environ["WORLD_SIZE"])
    else:
        n_ranks = cfg.ranks
    check_config(cfg, n_ranks)
    out = Path(cfg.out)
    if launched_by_env() or dist.is_initialized():
        if _global_rank() == 0:
            write_config(cfg, out)
        mine = train_rank(cfg, on_step)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return None
        return write_report(cfg, _by_rank(gathered), out)
    write_config(cfg, out)
    logs = out / RANK_LOGS
    logs.mkdir(parents=True, exist_ok=True)
    (out / ERROR_LOG).unlink(missing_ok=True)
    try:
        results = launch(
            train_rank if cfg.verbose else _train_rank_logged,
            cfg.ranks,
            cfg,
            on_step,
            *(() if cfg.verbose else (str(logs),)),
            threads_per_rank=cfg.threads,
            group_timeout=cfg.timeout,
        )
    except LaunchError as exc:
        write_error_log(exc, out)
        raise
    return write_report(cfg, _by_rank(results), out)


def _train_rank_logged(cfg: TrainConfig, on_step: StepHook | None, logs: str) -> RankResult:
    """:func:`train_rank` with this rank's stderr in ``logs/rank<N>.log``."""
    terminal = send_stderr_to(Path(logs) / f"rank{dist.get_rank()}.log")
    try:
        return train_rank(cfg, on_step, progress_stream=terminal)
    finally:
        terminal.close()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])


def _by_rank(results: list[Any]) -> list[RankResult]:
    return sorted((r for r in results if r is not None), key=lambda r: r.rank)
