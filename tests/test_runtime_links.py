"""The links of the point-to-point transfers, and binding the default group to a GPU.

Pure parts, without processes: which pairs of ranks neighbour in each
schedule, the one order in which every rank makes and warms up their links,
and the device a default group is bound to under NCCL (no CUDA call, so it
runs here). The links themselves run in every distributed test; the order
of groups across ranks is checked in ``tests/test_runtime_order_only.py``.
"""

from __future__ import annotations

import pytest
import torch

from twobp.runtime.base.group import bound_device, device_of_local_rank
from twobp.runtime.communication.links import link_order, neighbour_pairs
from twobp.runtime.execution.step_run import (
    REDUCE_AFTER_TRANSFERS_VARIABLE,
    reduction_order,
    reductions_wait_for_transfers,
)
from twobp.schedule import generate


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches", "pairs"),
    [
        ("1f1b", 4, 4, [(0, 1), (1, 2), (2, 3)]),
        ("zb-v", 2, 4, [(0, 1)]),
        ("zb-v", 4, 4, [(0, 1), (1, 2), (2, 3)]),
        ("interleaved-1f1b", 4, 4, [(0, 1), (0, 3), (1, 2), (2, 3)]),
        ("chimera", 4, 4, [(0, 1), (1, 2), (2, 3)]),
        ("dualpipe", 4, 8, [(0, 1), (1, 2), (2, 3)]),
        ("1f1b", 1, 2, []),
    ],
)
def test_neighbour_pairs_of_each_schedule(name, ranks, microbatches, pairs):
    assert neighbour_pairs(generate(name, ranks, microbatches)) == pairs


def test_links_go_pair_by_pair_the_lower_rank_first():
    assert link_order([(2, 1), (0, 1), (1, 2), (3, 0)]) == [
        (0, 1),
        (1, 0),
        (0, 3),
        (3, 0),
        (1, 2),
        (2, 1),
    ]
    assert link_order([(1, 1)]) == []


def test_every_rank_meets_its_links_in_the_order_of_all_links():
    # A rank warms up only its own links, in the world's order: a total order of pairs,
    # so no two ranks wait on each other's link first.
    order = link_order([(0, 1), (1, 2), (2, 3), (0, 3)])
    for rank in range(4):
        mine = [link for link in order if rank in link]
        assert mine == sorted(mine, key=order.index)
        assert len(mine) == 4


def test_nccl_binds_the_default_group_to_this_ranks_gpu():
    assert bound_device("nccl", torch.device("cpu"), 3) == torch.device("cuda", 3)
    assert bound_device("nccl", torch.device("cuda"), 2) == torch.device("cuda", 2)
    assert bound_device("nccl", torch.device("cuda", 1), 2) == torch.device("cuda", 1)
    assert bound_device("gloo", torch.device("cuda", 1), 2) is None
    assert bound_device("gloo", torch.device("cpu"), 0) is None


def test_the_local_rank_picks_a_gpu_round_robin():
    assert device_of_local_rank(5, 4) == torch.device("cuda", 1)
    assert device_of_local_rank(0, 8) == torch.device("cuda", 0)
    assert device_of_local_rank(3, 0) == torch.device("cpu")


def test_reductions_wait_for_the_transfers_on_nccl_only(monkeypatch):
    monkeypatch.delenv(REDUCE_AFTER_TRANSFERS_VARIABLE, raising=False)
    assert reductions_wait_for_transfers("nccl")
    assert not reductions_wait_for_transfers("gloo")
    assert not reductions_wait_for_transfers(None)
    # The pipeline option reduce_after_transfers, or the variable (read when a pipeline is
    # built), applies the NCCL rule on any backend.
    assert reductions_wait_for_transfers("gloo", requested=True)
    monkeypatch.setenv(REDUCE_AFTER_TRANSFERS_VARIABLE, "1")
    assert reductions_wait_for_transfers("gloo")


def test_deferred_reductions_start_by_model_stage_on_every_rank():
    # Chimera on 4 ranks: rank 0 holds stage 0 (down) and stage 7 (model stage 3, up), rank 3
    # the other way round; both start model stage 0's reduction first.
    graph = generate("chimera", 4, 4).graph
    assert reduction_order([7, 0], graph) == [0, 7]
    assert reduction_order([3, 4], graph) == [4, 3]
    assert reduction_order([2, 1], generate("1f1b", 4, 4).graph) == [1, 2]
