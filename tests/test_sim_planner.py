"""The planner as data: candidates of unit costs, ordered, and the one it recommends."""

import math

import pytest

from twobp.sim import CostModel
from twobp.sim.planner import Candidate, build_schedule, evaluate, recommend

UNIT = CostModel.uniform(4)


def test_candidates_come_fastest_first_and_refusals_last():
    candidates = evaluate(UNIT, 4, 6, ["1f1b", "interleaved-1f1b"], ["off", "paper"])
    ran = [c for c in candidates if c.ok]
    assert [c.makespan for c in ran] == sorted(c.makespan for c in ran)
    assert (ran[0].schedule, ran[0].policy) == ("1f1b", "paper")
    # Interleaved 1F1B needs m to be a multiple of p: listed last, with the reason.
    refused = candidates[len(ran) :]
    assert {c.schedule for c in refused} == {"interleaved-1f1b"}
    assert all(c.error and math.isinf(c.makespan) for c in refused)


def test_a_memory_limit_bounds_fill_and_picks_what_fits():
    candidates = evaluate(UNIT, 4, 8, ["1f1b"], ["off", "paper", "fill"], memory_limit=5.0)
    by_policy = {c.policy: c for c in candidates}
    assert by_policy["fill"].peak_memory <= 5.0 < by_policy["paper"].peak_memory
    assert recommend(candidates, 5.0).startswith("Recommended: 1f1b with 2BP (fill)")


def test_nothing_that_fits_names_the_smallest():
    candidates = evaluate(UNIT, 4, 4, ["1f1b", "gpipe"], ["off"], memory_limit=0.5)
    assert recommend(candidates, 0.5).startswith(
        "No schedule fits memory_limit=0.5 per rank: 1f1b needs the least (4)"
    )
    assert recommend([Candidate("1f1b", "off", error="no")], None).startswith("Nothing could")


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown schedule or policy 'lazy'; schedules: "):
        evaluate(UNIT, 4, 4, ["1f1b"], ["lazy"])


def test_a_built_schedule_gets_the_costs_of_its_stages():
    schedule, fitted = build_schedule("interleaved-1f1b", 2, 4, 2, "paper", CostModel.uniform(2))
    assert schedule.n_stages == fitted.n_stages == 4


def test_planner_candidates_carry_their_stages_per_rank_and_are_named_by_them():
    from twobp.sim.search import describe

    candidates = evaluate(UNIT, 4, 8, ["gpipe", "interleaved-1f1b", "1f1b"], ["paper"], 2)
    by_name = {c.schedule: c for c in candidates}
    assert {n: c.stages_per_rank for n, c in by_name.items()} == {
        "gpipe": 1,  # the planner gives V to interleaved-1f1b only
        "interleaved-1f1b": 2,
        "1f1b": 1,
    }
    assert describe(by_name["gpipe"]) == "gpipe (V=1) with 2BP (paper)"
    assert describe(by_name["interleaved-1f1b"]) == "interleaved-1f1b (V=2) with 2BP (paper)"
    assert describe(by_name["1f1b"]) == "1f1b with 2BP (paper)"
    best = next(c for c in candidates if c.ok)
    assert recommend(candidates, None).startswith(f"Recommended: {describe(best)}: ")
    # Not built: no stages per rank to show.
    assert describe(Candidate("gpipe", "off", error="no")) == "gpipe"
