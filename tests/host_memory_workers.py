"""Functions run on every rank by the tests of host memory retention
(``test_runtime_host_memory``)."""

from __future__ import annotations

import resource

import torch
import torch.nn.functional as F
from torch import nn

from twobp.runtime import Pipeline

STEPS = 4
"""Rounds of the allocation pattern; the first faults its pages in any case and is not counted."""


def faults_of_steps() -> int:
    """Minor page faults of a step-like pattern after the first: many blocks held, then all freed.

    Each round allocates 24 blocks of 4 MiB, writes them (a page faults on its
    first write), and frees them all, as a step frees its activations.
    """
    counts = []
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = [torch.ones(1 << 20) for _ in range(24)]
        del held
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(counts[1:])


def faults_after_pipeline(retain_host_memory: bool) -> int:
    """Build a CPU pipeline, then count the faults of :func:`faults_of_steps`."""
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4), nn.Linear(4, 1)]
    Pipeline(
        blocks,
        F.mse_loss,
        schedule="gpipe",
        n_microbatches=2,
        device="cpu",
        retain_host_memory=retain_host_memory,
    ).close()
    return faults_of_steps()
