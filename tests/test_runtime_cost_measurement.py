"""What ``schedule="auto"`` measures between ranks, on real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from auto_schedule_workers import (
    BANDWIDTH,
    LATENCY,
    allreduce_figures,
    link_figures,
    measured_link,
    plan_with_copies,
)
from twobp.runtime import launch
from twobp.runtime.base.group import Membership
from twobp.runtime.setup.auto.cost_measurement import allreduce_speed


@pytest.mark.timeout(120)
def test_the_link_between_any_two_ranks_is_measured_and_shared_with_every_rank():
    # Rank 1 stands by: the link is between group ranks 2 and 0, in that order.
    figures = launch(link_figures, 3, (2, 0), 2**16, threads_per_rank=1, timeout=90)
    assert figures[0] == figures[1] == figures[2]
    latency, bandwidth = figures[0]
    assert 0 < latency < 1 and bandwidth > 0


@pytest.mark.timeout(120)
def test_copies_of_a_one_rank_pipeline_have_no_link_between_stages_to_measure():
    # Ranks 0 and 1 run two copies: what passes between them is a gradient
    # reduction, not a stage boundary's activation.
    links = launch(measured_link, 2, "mlp", 4, 8, 2, threads_per_rank=1, timeout=90)
    assert links == [(0.0, math.inf, 0.0)] * 2


@pytest.mark.timeout(120)
def test_auto_plans_copies_with_their_gradient_all_reduce():
    # Two copies of a one-rank pipeline: every candidate all-reduces its stage's gradients
    # over the copies, at the all-reduce bandwidth measured between them.
    plans = launch(plan_with_copies, 2, "mlp", 4, 8, 2, threads_per_rank=1, timeout=90)
    assert plans[0] == plans[1]
    bandwidth, reduces, predicted, bare = plans[0]
    assert bandwidth is not None and 0 < bandwidth < math.inf
    assert reduces
    assert predicted > bare


@pytest.mark.timeout(120)
def test_the_all_reduce_bandwidth_predicts_an_all_reduce_of_another_size():
    # Timed by a ring all-reduce at a known bandwidth (the all-reduces themselves run), the
    # measurement finds that bandwidth, and predicts another size as the ring does: a
    # bytes/elements mix-up would be off by 4x. Measured for real, every rank learns rank
    # 0's figure.
    figures = launch(allreduce_figures, 2, 4 * 2**20, 8 * 2**20, threads_per_rank=1, timeout=90)
    assert figures[0]["measured"] == figures[1]["measured"]
    assert 0 < figures[0]["measured"] < math.inf
    for f in figures:
        assert math.isclose(f["modelled"], BANDWIDTH, rel_tol=1e-9), f
        assert math.isclose(f["predicted"], f["model"], rel_tol=1e-9), f
        # The latency per ring step: a small all-reduce over its 2 (n - 1) steps.
        assert math.isclose(f["latency"], LATENCY, rel_tol=1e-3), f


def test_an_all_reduce_needs_two_ranks():
    world = Membership.of(0, 1, 1, None, "gloo")
    assert allreduce_speed(world, torch.device("cpu"), 2**20) == math.inf
