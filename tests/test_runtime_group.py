"""Threads of a rank: a fair share of the machine's cores unless the user chose (no processes)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from twobp.runtime.base.group import set_threads_per_rank


@pytest.fixture
def eight_cores(monkeypatch) -> Iterator[None]:
    """A process that may run on 8 cores, without OMP_NUM_THREADS; threads restored after."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("local_ranks", "share"), [(1, 8), (2, 4), (3, 2), (8, 1), (16, 1)])
def test_the_default_is_the_cores_over_the_local_ranks(eight_cores, local_ranks, share):
    torch.set_num_threads(8)
    assert set_threads_per_rank(local_ranks, None) == share
    assert torch.get_num_threads() == share


def test_the_default_only_lowers_the_count(eight_cores):
    torch.set_num_threads(2)
    assert set_threads_per_rank(2, None) == 2  # below the share of 4: left as it is
    assert torch.get_num_threads() == 2


def test_an_explicit_count_or_omp_num_threads_wins(eight_cores, monkeypatch):
    torch.set_num_threads(8)
    assert set_threads_per_rank(2, 6) == 6 and torch.get_num_threads() == 6
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    torch.set_num_threads(8)
    assert set_threads_per_rank(4, None) == 8 and torch.get_num_threads() == 8
