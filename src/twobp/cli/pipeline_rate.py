"""How much slower blocks compute inside a running pipeline than profiled alone.

A profile times each block on its own, again and again, its weights warm in the
caches. In a pipeline each rank alternates its blocks over many micro-batches
while its neighbours compute beside it on the same machine, so every action
takes longer. This runs a short 1F1B step with 2BP on ``n`` local ranks, reads
each rank's compute time from the pipeline's timeline and divides it by what
the profiled costs of its blocks add up to. The ratio is the
``CostModel.contention`` of this machine for that model and micro-batch.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist


def _rank(
    family: str,
    size: str,
    changes: Mapping[str, Any],
    dtype: Any,
    microbatch: int,
    sizes: Sequence[int],
    microbatches: int,
    steps: int,
) -> float:
    from twobp.models import build_model
    from twobp.runtime import Pipeline
    from twobp.timeline import busy_time

    spec = build_model(family, size, dtype=dtype, **changes)
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        "1f1b",
        n_microbatches=microbatches,
        two_bp=True,
        partition=list(sizes),
    )
    inputs, targets = spec.make_batch(microbatch * microbatches, 0)
    rank = dist.get_rank()
    busy = []
    for step in range(steps + 1):
        pipe.zero_grad()
        pipe.step(inputs, targets)
        spans = pipe.timeline()
        if step:  # the first step warms up
            busy.append(busy_time(spans, rank))
    pipe.close()
    return statistics.median(busy)


def pipeline_slowdown(
    family: str,
    size: str,
    changes: Mapping[str, Any],
    dtype: Any,
    microbatch: int,
    sizes: Sequence[int],
    profiled: Sequence[float],
    *,
    microbatches: int = 4,
    steps: int = 3,
    threads: int = 1,
) -> float:
    """Compute time per rank in a running pipeline over the profiled time (at least 1).

    Args:
        family, size, changes, dtype: the model (:func:`twobp.models.build_model`).
        microbatch: samples per micro-batch.
        sizes: blocks per stage, one stage per local rank.
        profiled: per stage, the profiled ``F + I + W`` of one micro-batch (seconds).
        microbatches, steps: of the run (one more step warms up).
        threads: torch threads per rank.
    """
    from twobp.runtime import launch

    busy = launch(
        _rank,
        len(sizes),
        family,
        size,
        dict(changes),
        dtype,
        microbatch,
        tuple(sizes),
        microbatches,
        steps,
        threads_per_rank=threads,
        timeout=600.0,
    )
    ratios = [b / (microbatches * p) for b, p in zip(busy, profiled, strict=True)]
    return max(1.0, statistics.fmean(ratios))
