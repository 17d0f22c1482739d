"""Recompute modes as data: the option, the cost and memory model, the planner."""

from __future__ import annotations

import pytest

from twobp.schedule import Action, Kind
from twobp.sim import CostModel, memory_timeline, peak_memory
from twobp.sim.planner import evaluate, recommend
from twobp.sim.recompute import (
    effective_modes,
    parse_recompute,
    recomputes_activations,
    recomputes_derivatives,
    with_recompute,
)
from twobp.timeline import Span

COSTS = CostModel.uniform(
    2, f=1.0, i=2.0, w=3.0, activation_bytes=10.0, weight_grad_bytes=8.0, send_bytes=1.0
)


def test_the_option_is_one_mode_per_stage():
    assert parse_recompute(None, 3) == (None, None, None)
    assert parse_recompute("all", 2) == ("all", "all")
    assert parse_recompute(["derivatives", None], 2) == ("derivatives", None)
    assert parse_recompute(("off", "activations"), 2) == (None, "activations")
    assert [recomputes_activations(m) for m in (None, "activations", "derivatives", "all")] == [
        False,
        True,
        False,
        True,
    ]
    assert [recomputes_derivatives(m) for m in (None, "activations", "derivatives", "all")] == [
        False,
        False,
        True,
        True,
    ]


def test_a_bad_option_names_itself_and_the_choices():
    with pytest.raises(ValueError, match=r"recompute='act': unknown mode; choose one of None, "):
        parse_recompute("act", 2)
    with pytest.raises(ValueError, match=r"recompute=.* \(stage 1\): unknown mode"):
        parse_recompute([None, 3], 2)
    with pytest.raises(ValueError, match=r"3 entries for 2 stages"):
        parse_recompute(["all", "all", "all"], 2)


def test_a_stage_that_runs_b_has_no_stash_to_recompute():
    modes = ("derivatives", "all", "derivatives", "activations")
    assert effective_modes(modes, split={2}) == (None, "activations", "derivatives", "activations")


def test_activations_hold_the_input_and_run_f_again_in_i_and_b():
    c = with_recompute(COSTS, "activations")
    assert c.activation_bytes == (1.0, 1.0)  # the input (stage 0: as large as its output)
    assert c.backward_input == (3.0, 3.0) and c.backward_full == (6.0, 6.0)
    assert c.weight_grad_bytes == COSTS.weight_grad_bytes and c.backward_weight == (3.0, 3.0)


def test_derivatives_hold_input_and_output_gradient_and_run_f_and_i_again_in_w():
    c = with_recompute(COSTS, ["derivatives", None])
    assert c.weight_grad_bytes == (2.0, 8.0)
    assert c.backward_weight == (6.0, 3.0) and c.backward_input == (2.0, 2.0)
    assert c.w_time(0, 4) == 24.0
    assert c.weight_rebuild_bytes == (8.0, 0.0)
    assert c.weight_rebuild_peak(0, 4) == 32.0  # no cap: the whole W's stash


def test_a_cap_on_w_groups_sums_their_times_and_bounds_the_rebuild():
    table = CostModel.uniform(1, w=1.0, weight_concat={1: 1.0, 2: 1.5, 4: 2.0})
    capped = with_recompute(table, None, weight_group_size=2)
    assert capped.w_time(0, 4) == 3.0 and capped.w_time(0, 5) == 4.0
    both = with_recompute(COSTS, "derivatives", weight_group_size=2)
    assert both.weight_rebuild_peak(0, 4) == 16.0 and both.weight_rebuild_peak(0, 1) == 8.0
    assert with_recompute(COSTS, None) is COSTS
    with pytest.raises(ValueError, match="weight_group_size must be None or >= 1"):
        with_recompute(COSTS, None, weight_group_size=0)


def test_a_w_that_rebuilds_holds_the_group_while_it_runs():
    small = CostModel.uniform(2, activation_bytes=3.0, weight_grad_bytes=8.0, send_bytes=1.0)
    c = with_recompute(small, "derivatives", weight_group_size=1)
    spans = [
        Span(0, Action.parse("0F0"), 0.0, 1.0),
        Span(0, Action.parse("0I0"), 1.0, 3.0),
        Span(0, Action.parse("0F1"), 3.0, 4.0),
        Span(0, Action.parse("0I1"), 4.0, 6.0),
        Span(0, Action.make(0, Kind.BACKWARD_WEIGHT, (0, 1)), 6.0, 18.0),
    ]
    points = memory_timeline(spans, c, (0, 1))[0]
    # Two micro-batches of input and output gradient (2 each), then one rebuilt stash (8).
    assert max(b for _, b in points) == 12.0 == peak_memory(spans, c, (0, 1))[0]
    assert points[-1][1] == 0.0
    assert peak_memory(spans, small, (0, 1))[0] == 16.0  # two stashes


def test_the_planner_ranks_recompute_modes_and_names_them():
    candidates = evaluate(
        COSTS,
        2,
        8,
        ["1f1b"],
        ["off", "paper"],
        recomputes=["off", "activations", "derivatives", "all"],
        weight_group_sizes=[None, 2],
    )
    assert len(candidates) == 16 and all(c.ok for c in candidates)
    by = {(c.policy, c.recompute, c.weight_group_size): c for c in candidates}
    plain, derivatives = by[("paper", "off", None)], by[("paper", "derivatives", 2)]
    assert derivatives.peak_memory < plain.peak_memory
    assert derivatives.makespan > plain.makespan  # F and I again in W
    limit = derivatives.peak_memory
    best = next(c for c in candidates if c.peak_memory <= limit)
    assert recommend(candidates, limit).startswith(f"Recommended: {_label(best)}")
    assert "recompute='activations'" in recommend(candidates, 3.0)


def _label(c) -> str:
    label = c.schedule if c.policy == "off" else f"{c.schedule} with 2BP ({c.policy})"
    if c.recompute != "off":
        label += f", recompute={c.recompute!r}"
    if c.weight_group_size is not None:
        label += f", weight_group_size={c.weight_group_size}"
    return label


def test_nothing_fits_says_how_much_the_best_needs():
    candidates = evaluate(
        COSTS, 2, 8, ["1f1b"], ["paper"], recomputes=["off", "all"], weight_group_sizes=[1]
    )
    least = min(c.peak_memory for c in candidates)
    text = recommend(candidates, least / 2)
    assert text.startswith(f"No schedule fits memory_limit={least / 2:g} per rank")
    assert f"needs the least ({least:g})" in text and "recompute='all'" in text


def test_an_unknown_mode_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="unknown recompute mode 'some'; choose from off, "):
        evaluate(COSTS, 2, 4, ["1f1b"], ["off"], recomputes=["some"])


def test_a_w_group_cap_below_one_is_refused_by_the_planner():
    with pytest.raises(ValueError, match="weight_group_size must be None or >= 1, got 0"):
        evaluate(COSTS, 2, 4, ["1f1b"], ["off"], weight_group_sizes=[None, 0])
