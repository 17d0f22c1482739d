"""Tensor parallelism with sharded parameters: each tensor-parallel shard's pipeline
shards its local parameters over its data-parallel copies (8 ranks: D 2 x P 2 x T 2,
gloo, float64, against one process on the whole model), the gradients clipped by their
global norm (each shard of a split parameter counted once, a parameter every
tensor-parallel rank holds whole once)."""

from __future__ import annotations

import pytest

from tensor_sharded_workers import losses_against_one_process
from twobp.runtime import launch

SCHEDULES = ["1f1b", "zb-v"]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(losses_against_one_process, 8, SCHEDULES, timeout=600)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_losses_equal_one_process_with_and_without_sharding(results, schedule):
    for rank in results:
        assert rank[f"{schedule} sharded=True"] <= 1e-10, rank
        assert rank[f"{schedule} sharded=False"] <= 1e-10, rank


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_holds_its_share_of_its_shard(results, schedule):
    for rank in results:
        held = rank[f"{schedule} held"]
        # Parameters, gradients and AdamW's state of the rank's tensor-parallel shard: about
        # half at D = 2 (buffers and the rounding of flat buckets stay whole).
        assert held[True] <= 0.6 * held["whole"], held
        assert held[True] < held[False], held
