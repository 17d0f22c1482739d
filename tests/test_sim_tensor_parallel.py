"""The cost of a stage split over tensor-parallel ranks, and what a plan splits of a block."""

from __future__ import annotations

import math

import pytest
import torch

from twobp.models import build_model, tensor_parallel_plan
from twobp.models.tensor_parallel import planned_modules
from twobp.runtime.setup.auto.tensor_size import block_splits
from twobp.runtime.setup.tensor_parallel import block_plans
from twobp.sim import CostModel
from twobp.sim.costs import allreduce_time
from twobp.sim.tensor_parallel import BlockSplit, Link, tensor_parallel_costs

LINK = Link(bandwidth=1e6, latency=1e-3)


def test_one_rank_changes_nothing():
    model = CostModel.uniform(2, 1.0, 2.0, 3.0)
    splits = [BlockSplit(1.0, 1, 0, 1)] * 4
    assert tensor_parallel_costs(model, splits, (2, 2), 1, LINK, [1e3] * 4) is model


def test_the_split_share_runs_over_t_and_the_collectives_are_added_to_f_and_i():
    model = CostModel.uniform(2, 1.0, 2.0, 3.0, parameter_bytes=8.0, send_bytes=5.0)
    # Stage 0: a block left whole and a block split whole; stage 1: two split blocks.
    splits = [BlockSplit(), BlockSplit(1.0, 2, 0, 2), BlockSplit(1.0, 2, 0, 2), BlockSplit(1.0)]
    out = tensor_parallel_costs(model, splits, (2, 2), 2, LINK, [100.0] * 4)
    reduce = allreduce_time(100.0, 2, LINK.bandwidth, LINK.latency)
    kept = (0.75, 0.5)  # half the stage split, then all of it
    assert out.forward == pytest.approx((0.75 + 2 * reduce, 0.5 + 2 * reduce))
    assert out.backward_input == pytest.approx((1.5 + 2 * reduce, 1.0 + 2 * reduce))
    assert out.backward_weight == pytest.approx(tuple(3.0 * k for k in kept))
    assert out.backward_full == pytest.approx((3.75 + 2 * reduce, 2.5 + 2 * reduce))
    assert out.parameter_bytes == pytest.approx(tuple(8.0 * k for k in kept))
    assert out.send_bytes == model.send_bytes  # every shard's pipeline sends the whole state
    assert out.activation_bytes == model.activation_bytes


def test_a_free_link_costs_nothing_but_the_split():
    model = CostModel.uniform(1, 4.0, 4.0, 4.0)
    out = tensor_parallel_costs(
        model, [BlockSplit(1.0, 2, 1, 2)], (1,), 4, Link(math.inf, 0.0), [1e9]
    )
    assert out.forward == (1.0,) and out.backward_input == (1.0,)


def test_a_llama_layer_reduces_twice_each_way_and_its_ends_split_nothing():
    blocks = list(build_model("llama", "tiny", dtype=torch.float64).blocks)
    plans = block_plans(blocks, tensor_parallel_plan("llama"))
    splits = block_splits(blocks, planned_modules(blocks, plans))
    assert splits[0] == BlockSplit() and splits[-1] == BlockSplit()
    layer = splits[1]
    assert (layer.forward_reduces, layer.forward_gathers, layer.input_reduces) == (2, 0, 2)
    assert 0.95 < layer.share < 1.0  # all but the norms
