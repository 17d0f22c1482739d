"""The search of schedule x 2BP policy x W group cap x stages per rank, and grouped W placement."""

from __future__ import annotations

import pytest

from twobp.schedule import Kind, apply_two_bp, generate
from twobp.sim import CostModel, simulate
from twobp.sim.planner import build_schedule, evaluate
from twobp.sim.search import NothingFitsError, Option, choose, describe, options, search

# W over 4 micro-batches costs what 2 single ones do: grouping halves it.
CONCAT = CostModel.uniform(2, 1.0, 1.0, 1.0, weight_concat={1: 1.0, 2: 1.2, 4: 2.0})


def _weights(schedule):
    return [a for acts in schedule.actions.values() for a in acts if a.kind is Kind.BACKWARD_WEIGHT]


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_a_wait_gets_a_group_of_w_when_the_costs_make_it_cheaper(name):
    # F = 2, I = 1: at the end rank 0 waits for its last input gradient, long
    # enough for one W over 4 micro-batches (1.73 by the table) but not for 4 single ones.
    linear = CostModel.uniform(2, 2.0, 1.0, 1.0)
    grouping = CostModel.uniform(2, 2.0, 1.0, 1.0, weight_concat={1: 1.0, 2: 1.1, 8: 3.0})
    one_by_one = apply_two_bp(generate(name, 2, 8), "fill", costs=linear)
    grouped = apply_two_bp(generate(name, 2, 8), "fill", costs=grouping)
    assert [str(w) for w in _weights(one_by_one)] == ["0W0", "0W1", "0W2-7", "1W0-7"]
    assert [str(w) for w in _weights(grouped)] == ["0W0-3", "0W4-7", "1W0-7"]
    assert simulate(grouped, grouping).makespan < simulate(one_by_one, grouping).makespan


def test_fill_moves_zero_bubble_w_into_groups_that_beat_one_w_per_micro_batch():
    native = generate("zb-h2", 2, 8)
    placed = apply_two_bp(native, "fill", costs=CONCAT)
    assert simulate(placed, CONCAT).makespan < simulate(native, CONCAT).makespan


def test_a_group_cap_splits_every_w():
    capped = apply_two_bp(generate("1f1b", 2, 8), "paper", costs=CONCAT, microbatches_per_w=2)
    assert max(len(w.microbatches) for w in _weights(capped)) == 2
    assert capped.name.endswith("+2bp:paper:w2")
    with pytest.raises(ValueError, match="microbatches_per_w must be at least 1"):
        apply_two_bp(generate("1f1b", 2, 8), "paper", microbatches_per_w=0)


def test_options_cover_every_schedule_policy_cap_and_stage_count():
    listed = options(4)
    assert Option("zb-v", "fill", 2, 2) in listed
    assert Option("interleaved-1f1b", "off", 1) in listed
    assert Option("gpipe", "paper", 2, None) in listed
    capped = [o for o in listed if o.microbatches_per_w is not None]
    assert not [o for o in capped if o.policy in ("off", "eager")]
    assert not [o for o in capped if o.microbatches_per_w >= 4]


def test_search_orders_what_fits_fastest_first_and_choose_takes_the_first():
    ranked = search(options(8), 2, 8, CONCAT.for_stages)
    ran = [c for c in ranked if c.ok]
    assert [c.makespan for c in ran] == sorted(c.makespan for c in ran)
    best = choose(ranked, None)
    assert best == ran[0]
    # Grouped W makes 2BP faster than every schedule without it.
    assert best.policy != "off"
    fastest_off = min(c.makespan for c in ran if c.policy == "off")
    assert best.makespan < fastest_off


def test_a_memory_limit_keeps_what_fits_or_says_what_the_least_needs():
    ranked = search(options(8), 2, 8, CONCAT.for_stages, memory_limit=3.0)
    assert choose(ranked, 3.0).peak_memory <= 3.0
    least = r"memory_limit=0.5 per rank: .* needs the least \(1\);"
    with pytest.raises(NothingFitsError, match=least):
        choose(search(options(8), 2, 8, CONCAT.for_stages, 0.5), 0.5)


def test_describe_names_policy_cap_and_stage_count():
    ranked = search(
        [Option("gpipe", "fill", 2, 2), Option("zb-v", "off", 2)], 2, 4, CONCAT.for_stages
    )
    names = sorted(describe(c) for c in ranked)
    assert names == ["gpipe (V=2) with 2BP (fill, W groups <= 2)", "zb-v"]


def test_a_near_tie_goes_to_the_candidate_faster_without_contention():
    from twobp.sim.planner import Candidate

    contended = Candidate("1f1b", "off", 100.0, 0.1, 1.0, uncontended_makespan=90.0)
    overlapping = Candidate("zb-h2", "off", 101.0, 0.1, 1.0, uncontended_makespan=60.0)
    slower = Candidate("gpipe", "off", 110.0, 0.1, 1.0, uncontended_makespan=10.0)
    assert choose([contended, overlapping, slower], None) == overlapping
    assert choose([contended, slower], None) == contended


def test_contended_costs_are_also_simulated_without_contention():
    contended = CostModel.uniform(2, contention=2.0)
    (candidate,) = search([Option("1f1b", "paper", 1)], 2, 4, contended.for_stages)
    assert candidate.uncontended_makespan < candidate.makespan


@pytest.mark.parametrize(
    ("policy", "makespan"),
    [
        # Rank 1: 8 F of 1 and 8 B of 2, and 2 of waiting (2B6 and 2B7 wait a unit each
        # for rank 0's 3B6 and 3B7); rank 0's 0R0-3 ends with its replica's 2R4-7 at 26.
        ("off", 26.0),
        # Rank 1 never waits: 8 F and 8 I of 1, then W over 1, 4 and 3 micro-batches
        # (1 + 2 + 1.6 by the table).
        ("paper", 20.6),
        ("fill", 20.6),
    ],
)
def test_search_costs_chimera_as_two_pipelines_of_the_models_stages(policy, makespan):
    # Chimera runs two pipelines of the model's 2 stages: each pipeline gets the
    # 2-stage costs (4 half stages would give about half these makespans).
    (found,) = search([Option("chimera", policy, 1)], 2, 8, CONCAT.for_stages)
    (planned,) = evaluate(CONCAT, 2, 8, ["chimera"], [policy])
    assert found.ok and planned.ok
    assert found.makespan == pytest.approx(makespan, abs=1e-9)
    assert planned.makespan == pytest.approx(makespan, abs=1e-9)
    _, fitted = build_schedule("chimera", 2, 8, None, policy, CONCAT.for_stages)
    assert fitted == CONCAT.tile(2)


def test_search_reduces_the_gradients_of_chimera_replicas():
    # Gradients of 4 units per stage over a link of 1 unit per time: the
    # all-reduce between the two pipelines lengthens the step.
    heavy = CostModel.uniform(2, parameter_bytes=4.0, bandwidth=1.0)
    light = CostModel.uniform(2)
    (slow,) = search([Option("chimera", "paper", 1)], 2, 4, heavy.for_stages)
    (fast,) = search([Option("chimera", "paper", 1)], 2, 4, light.for_stages)
    assert slow.makespan > fast.makespan


def test_microbatch_counts_cut_the_batch_evenly_in_multiples_of_the_ranks():
    from twobp.sim.search import microbatch_counts

    assert microbatch_counts(16, 2) == [2, 4, 8, 16]
    assert microbatch_counts(12, 2) == [2, 4]
    assert microbatch_counts(9, 2) == [3, 9]
    assert microbatch_counts(1, 2) == [1]
    with pytest.raises(ValueError, match="0 samples"):
        microbatch_counts(0, 2)
