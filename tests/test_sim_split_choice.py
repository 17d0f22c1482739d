"""Which stages split their backward: simulated per set of split stages (no torch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from twobp.schedule.prepare import source_schedule
from twobp.sim.costs import CostModel
from twobp.sim.split_choice import SPLIT_MARGIN, choose_split


def _costs(n_stages: int, *, price: float, w: float = 1.0) -> CostModel:
    """Unit F, I and B = I + W; the split's F costs ``price`` more than a fused stage's."""
    unit = CostModel.uniform(n_stages, f=1.0 + price, i=1.0, w=w, b=1.0 + w)
    return replace(unit, forward_full=(1.0,) * n_stages)


def test_a_free_split_pays_where_w_fills_the_bubble():
    schedule = source_schedule("1f1b", n_ranks=4, n_microbatches=4)
    choice = choose_split(schedule, _costs(4, price=0.0))
    assert choice.step < choice.fused_step
    assert choice.step <= choice.split_step
    # The first stage's W has no bubble to fill (its I and W run as one B anyway).
    assert choice.split[1:] == (True, True, True)


def test_an_expensive_split_is_not_paid_anywhere():
    schedule = source_schedule("1f1b", n_ranks=4, n_microbatches=4)
    choice = choose_split(schedule, _costs(4, price=2.0))
    assert choice.split == (False,) * 4
    assert choice.step == choice.fused_step < choice.split_step
    assert "2BP on no stage" in choice.summary()


def test_within_the_margin_the_fewest_stages_split():
    schedule = source_schedule("1f1b", n_ranks=2, n_microbatches=8)
    costs = _costs(2, price=0.0)
    best = choose_split(schedule, costs, margin=0.0)
    assert any(best.split)
    fewer = choose_split(schedule, costs, margin=1.0)
    assert fewer.split == (False, False)


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b", "chimera"])
def test_every_replica_and_stage_of_the_model_is_chosen_alike(name):
    schedule = source_schedule(name, n_ranks=2, n_microbatches=4)
    choice = choose_split(
        schedule, _costs(schedule.pipeline_stages, price=0.0).tile(schedule.n_pipelines)
    )
    assert len(choice.split) == schedule.pipeline_stages
    assert choice.step <= min(choice.fused_step, choice.split_step) * (1 + SPLIT_MARGIN)


def test_for_split_runs_the_fused_stages_forward_without_the_engine():
    costs = replace(CostModel.uniform(3, f=2.0), forward_full=(1.0, 1.5, 0.5))
    assert costs.for_split([1]).forward == (1.0, 2.0, 0.5)
    assert costs.for_split([0, 1, 2]) is costs
    assert CostModel.uniform(2, f=2.0).forward_full == (2.0, 2.0)


def test_the_line_says_why_a_slower_prediction_was_chosen():
    schedule = source_schedule("1f1b", n_ranks=2, n_microbatches=8)
    costs = _costs(2, price=0.0)
    fewer = choose_split(schedule, costs, margin=1.0)
    assert fewer.step > min(fewer.fused_step, fewer.split_step)
    assert "faster predicted, within the 100% margin a split must beat" in fewer.summary()
    # The fastest chosen: nothing to explain.
    best = choose_split(schedule, costs, margin=0.0)
    assert best.step == min(best.fused_step, best.split_step)
    assert "margin" not in best.summary()
