"""Rank bodies of the bench tests (module level, so that spawned ranks can import them)."""

from __future__ import annotations

import time

import torch

from twobp.bench.profile import measure_contention


def sleeping_contention(seconds: float) -> float:
    """The contention of a workload that only sleeps (it shares nothing)."""
    return measure_contention(lambda: time.sleep(seconds), torch.device("cpu"))
