"""What the start and the end of every step agree on: between two gloo ranks a
point-to-point exchange, the same sum on both ranks as an all-reduce; more ranks all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime_models import build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline, launch
from twobp.runtime.base.group import join_world
from twobp.runtime.communication import collective


def _sums() -> tuple[list[float], list[float]]:
    world = join_world(torch.device("cpu"), 60.0, None)
    mine = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(world.rank))
    reduced = mine.clone()
    dist.all_reduce(reduced)
    return collective.sum_small(world, mine.clone(), 60.0, "a test").tolist(), reduced.tolist()


def test_the_sum_is_the_all_reduces_on_every_rank():
    for ranks in (2, 3):
        results = launch(_sums, ranks, threads_per_rank=1, timeout=120)
        assert all(summed == reduced for summed, reduced in results), results
        assert all(summed == results[0][0] for summed, _ in results)


def _all_reduces_per_step() -> list[int]:
    """All-reduces each of three steps of a 2-rank pipeline makes (its first step learns the
    layouts; the others are what every step costs)."""
    pipe = Pipeline(build_blocks("mlp"), loss_fn("mlp"), schedule="1f1b", n_microbatches=2)
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    counts = []
    dist.all_reduce = counted
    try:
        for step in range(3):
            calls.clear()
            pipe.step(*make_batch("mlp", step, 4))
            counts.append(len(calls))
    finally:
        dist.all_reduce = real
        pipe.close()
    return counts


def test_a_step_of_two_gloo_ranks_makes_no_all_reduce():
    for counts in launch(_all_reduces_per_step, 2, threads_per_rank=1, timeout=120):
        assert counts[1:] == [0, 0], counts
