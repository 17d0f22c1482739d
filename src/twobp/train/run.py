"""Start a training run: local ranks of our own, or the ranks ``torchrun`` started."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import torch.distributed as dist

from twobp.runtime import LaunchError, launch
from twobp.runtime.base.group import launched_by_env
from twobp.train.config import TrainConfig
from twobp.train.console import Console, start_log
from twobp.train.failures import ERROR_LOG, RANK_LOGS, send_stderr_to, write_error_log
from twobp.train.loop import RankResult, StepHook, train_rank
from twobp.train.out_folder import delete_foreign_checkpoints
from twobp.train.preflight import check_config
from twobp.train.report import write_config, write_report
from twobp.train.stopping import StopSignals, TrainingInterrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, ``kill``, and the hang-up of a terminal that closed: each ends the run with a
checkpoint."""


def run_training(cfg: TrainConfig, on_step: StepHook | None = None) -> dict[str, Any] | None:
    """Train as ``cfg`` says; write its options (``OUT/config.toml``) first, the report last.

    Under ``torchrun`` this process is one rank: the results are gathered to
    rank 0, which writes the report and returns the summary (other ranks
    return None). Otherwise ``cfg.ranks`` local processes are started; unless
    ``cfg.verbose``, their stderr goes to ``OUT/logs/rank<N>.log``, and if
    any fails, every failed rank's traceback goes to ``OUT/errors.log`` (see
    :mod:`twobp.train.failures`). With ``cfg.overwrite``, the checkpoints of
    ``OUT/checkpoints`` that this run does not continue are deleted first.

    SIGINT, SIGTERM and SIGHUP end the run after the step in flight, with a
    checkpoint and the report; a second one stops at once (see
    :mod:`twobp.train.stopping`). A console that goes away (a closed pipe, a
    terminal that hung up) does not end it: the notices go on into
    ``OUT/train.log`` (see :mod:`twobp.train.console`).

    Args:
        cfg: the run's options.
        on_step: called on every rank with ``(rank, step)`` before each step
            (a picklable module-level function when local ranks are started).

    Raises:
        twobp.runtime.LaunchError: if a local rank failed (it names the rank).
        twobp.train.preflight.OptionError: on options that cannot work (before
            any rank starts).
        twobp.train.stopping.TrainingInterrupted: on every rank, after the
            report, if a signal stopped the run early.
        KeyboardInterrupt: on a second signal.
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
            delete_foreign_checkpoints(cfg)
            write_config(cfg, out)
            start_log(out)
        # Each rank is its own: torchrun forwards SIGINT and SIGTERM to every one.
        mine = train_rank(cfg, on_step, stop_signals=STOP_SIGNALS)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        summary = write_report(cfg, _by_rank(gathered), out) if dist.get_rank() == 0 else None
        _raise_if_interrupted(mine, summary)
        return summary
    delete_foreign_checkpoints(cfg)
    write_config(cfg, out)
    start_log(out)
    logs = out / RANK_LOGS
    logs.mkdir(parents=True, exist_ok=True)
    (out / ERROR_LOG).unlink(missing_ok=True)
    stop = StopSignals(STOP_SIGNALS, on_first=functools.partial(_tell_the_ranks, Console(out)))
    try:
        with stop:
            results = launch(
                _train_local_rank,
                cfg.ranks,
                cfg,
                on_step,
                None if cfg.verbose else str(logs),
                threads_per_rank=cfg.threads,
                group_timeout=cfg.timeout,
            )
    except LaunchError as exc:
        write_error_log(exc, out)
        if stop.requested and _only_interrupted(exc):
            raise KeyboardInterrupt from None  # Ctrl-C while the ranks were starting
        raise
    by_rank = _by_rank(results)
    summary = write_report(cfg, by_rank, out)
    _raise_if_interrupted(by_rank[0], summary)
    return summary


def _train_local_rank(cfg: TrainConfig, on_step: StepHook | None, logs: str | None) -> RankResult:
    """:func:`train_rank` on a local rank; unless ``logs`` is None, its stderr goes there."""
    if logs is None:
        return train_rank(cfg, on_step)
    terminal = send_stderr_to(Path(logs) / f"rank{dist.get_rank()}.log")
    try:
        return train_rank(cfg, on_step, progress_stream=terminal)
    finally:
        terminal.close()


def _tell_the_ranks(console: Console, number: int) -> None:
    """Pass a stop signal that reached this launcher on to its ranks, as SIGINT.

    Ctrl-C reaches the ranks by itself (it signals the terminal's whole
    process group); ``kill`` or a job scheduler may signal this process only.
    """
    console.warn(
        "twobp train: stopping after the step in flight, then saving a checkpoint "
        "(Ctrl-C again to stop at once)"
    )
    for child in multiprocessing.active_children():
        # The launcher names its ranks so; other children of this process are not ours.
        if child.name.startswith("twobp-rank-") and child.pid is not None:
            os.kill(child.pid, signal.SIGINT)


def _only_interrupted(error: LaunchError) -> bool:
    """True if no rank failed other than by the interrupt, or through a peer that did."""
    return all(f.error_type in ("", "KeyboardInterrupt", *_PEER_ERRORS) for f in error.failures)


_PEER_ERRORS = ("PeerError", "PeerFailedError", "PeerTimeoutError")


def _raise_if_interrupted(result: RankResult, summary: dict[str, Any] | None) -> None:
    if result.interrupted:
        raise TrainingInterrupted(len(result.losses), result.checkpoint, summary)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])


def _by_rank(results: list[Any]) -> list[RankResult]:
    return sorted((r for r in results if r is not None), key=lambda r: r.rank)
