"""Rank bodies of the bench tests (module level, so that spawned ranks can import them)."""

from __future__ import annotations

import fcntl
import sys
import time

import torch

from twobp_bench.config import BenchPlan, Regime
from twobp_bench.job import RankReport, run_regime
from twobp_bench.profile import measure_contention, measure_link


def sleeping_contention(seconds: float) -> float:
    """The contention of a workload that only sleeps (it shares nothing)."""
    return measure_contention(lambda: time.sleep(seconds), torch.device("cpu"))


def exclusive_contention(lock_path: str, seconds: float) -> float:
    """The contention of a workload that holds a lock every rank needs (one run each).

    Alone a run takes ``seconds``; together the rank that gets the lock second
    waits for the first, so its run takes about twice as long.
    """

    def work() -> None:
        with open(lock_path, "a") as f:
            fcntl.lockf(f, fcntl.LOCK_EX)
            try:
                time.sleep(seconds)
            finally:
                fcntl.lockf(f, fcntl.LOCK_UN)

    return measure_contention(work, torch.device("cpu"), repeats=1)


def link(nbytes: int) -> tuple[float, float]:
    """The bench's measure of the link between ranks 0 and 1."""
    return measure_link(nbytes, torch.device("cpu"))


def regime_without_deepspeed(plan: BenchPlan, regime: Regime) -> RankReport:
    """One regime of the bench on a rank where ``import deepspeed`` fails, as where it is
    not installed (a ``None`` in ``sys.modules`` makes the import raise ModuleNotFoundError)."""
    sys.modules["deepspeed"] = None  # type: ignore[assignment]
    return run_regime(plan, regime)
