"""Ranks that slow each other while they compute at once (CostModel.contention)."""

import json
import math
import random
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from twobp.schedule import SCHEDULES, apply_two_bp, generate
from twobp.schedule.action import Action
from twobp.schedule.schedule import Schedule
from twobp.sim.contention import simulate_shared, slowdown
from twobp.sim.cost_io import costs_from_json, costs_to_json, load_costs, parse_costs, save_costs
from twobp.sim.costs import CostModel
from twobp.sim.simulate import DeadlockError, simulate


def make(placement, m, rows, name="hand"):
    return Schedule(
        tuple(placement),
        m,
        {r: tuple(Action.parse(t) for t in row.split()) for r, row in rows.items()},
        name,
    )


def timeline(result):
    return [(s.rank, str(s.action), s.start, s.end) for s in result.spans]


def random_costs(rng, n_stages, contention=1.0):
    def times():
        return tuple(rng.uniform(0.1, 3.0) for _ in range(n_stages))

    return CostModel(
        forward=times(),
        backward_input=times(),
        backward_weight=times(),
        send_latency=rng.choice([0.0, 0.05, 0.5]),
        bandwidth=100.0,
        send_bytes=tuple(rng.uniform(0.0, 20.0) for _ in range(n_stages)),
        contention=contention,
    )


def all_schedules():
    for name in sorted(SCHEDULES):
        for p in range(1, 5):
            for m in (p, 2 * p):
                if name in ("chimera", "dualpipe") and (p % 2 or m % 2):
                    continue  # two pipelines: p and m even
                if name.startswith("dualpipe") and m < 2 * p:
                    continue
                for policy in (None, "eager", "paper"):
                    yield apply_two_bp(generate(name, p, m), policy)


def assert_same_timeline(got, expected):
    assert [s[:2] for s in timeline(got)] == [s[:2] for s in timeline(expected)]
    for a, b in zip(got.spans, expected.spans, strict=True):
        assert a.start == pytest.approx(b.start, abs=1e-9), (expected.name, a, b)
        assert a.end == pytest.approx(b.end, abs=1e-9), (expected.name, a, b)


def test_without_contention_the_fluid_run_matches_the_fixed_one():
    rng = random.Random(7)
    count = 0
    for schedule in all_schedules():
        costs = random_costs(rng, schedule.n_stages)
        fixed = simulate(schedule, costs)
        fluid = simulate_shared(schedule, costs)
        assert_same_timeline(fluid, fixed)
        assert fluid.peak_memory == fixed.peak_memory
        count += 1
    # chimera: p = 2, 4; dualpipev: m = 2p; dualpipe: p = 2, 4 and m = 2p
    assert count == (len(SCHEDULES) - 3) * 4 * 2 * 3 + 2 * 2 * 3 + 4 * 3 + 2 * 3


def test_zero_time_actions_end_at_once():
    costs = CostModel(forward=(0.0, 1.0), backward_input=(1.0, 0.0), backward_weight=(0.0, 0.0))
    schedule = apply_two_bp(generate("1f1b", 2, 4), "eager")
    assert_same_timeline(simulate_shared(schedule, costs), simulate(schedule, costs))
    shared = simulate(schedule, replace(costs, contention=2.0))
    free = [s for s in shared.spans if costs.duration(s.action) == 0]
    assert len(free) == 4 + 4 + 8  # 0F*, 1I*, and every W
    assert all(s.duration == 0 for s in free)


def test_slowdown_grows_linearly_from_one_rank_to_all():
    assert slowdown(2.0, 1, 4) == 1.0
    assert slowdown(2.0, 4, 4) == 2.0
    assert slowdown(3.0, 2, 3) == pytest.approx(2.0)  # 1 + (3 - 1) * 1 / 2
    assert slowdown(5.0, 3, 1) == 1.0
    assert slowdown(5.0, 0, 4) == 1.0


def test_two_actions_that_fully_overlap_both_take_twice_as_long():
    # 0F0 runs alone on [0, 1]; then 0F1 and 1F0 start together at 1 and
    # share the machine for all of their work: both take 2 instead of 1.
    schedule = make([0, 1], 2, {0: "0F0 0F1", 1: "1F0"})
    result = simulate(schedule, CostModel.uniform(2, contention=2.0))
    assert timeline(result) == [(0, "0F0", 0, 1), (0, "0F1", 1, 3), (1, "1F0", 1, 3)]
    assert result.busy == (3.0, 2.0)


def test_partial_overlap_takes_the_piecewise_time():
    # forward = (3, 1), one transfer takes 1, contention 2 on two ranks:
    #   0F0 alone on [0, 3].
    #   0F1 (work 3) starts at 3; 1F0 (work 1) may start at 3 + 1 = 4.
    #   [3, 4]: 0F1 alone, 1 work done, 2 left.
    #   [4, 6]: both at half speed: 1F0 does its 1 work and ends at 6;
    #           0F1 does 1 more, 1 left.
    #   [6, 7]: 0F1 alone, ends at 7 (3 + 1 + 2 + 1; alone it would end at 6).
    #   1F1 may start at 7 + 1 = 8 and runs alone on [8, 9].
    costs = CostModel(
        forward=(3.0, 1.0),
        backward_input=(1.0, 1.0),
        backward_weight=(1.0, 1.0),
        send_latency=1.0,
        contention=2.0,
    )
    schedule = make([0, 1], 2, {0: "0F0 0F1", 1: "1F0 1F1"})
    result = simulate(schedule, costs)
    assert timeline(result) == [
        (0, "0F0", 0, 3),
        (0, "0F1", 3, 7),
        (1, "1F0", 4, 6),
        (1, "1F1", 8, 9),
    ]
    assert result.makespan == 9.0
    assert result.busy == (7.0, 3.0)


def test_one_rank_has_no_one_to_share_with():
    schedule = apply_two_bp(generate("interleaved-1f1b", 1, 3), "paper")
    costs = random_costs(random.Random(3), schedule.n_stages)
    assert schedule.n_ranks == 1 and schedule.n_stages == 2
    slow = simulate(schedule, replace(costs, contention=4.0))
    assert_same_timeline(slow, simulate(schedule, costs))


def test_makespan_never_shrinks_as_contention_grows():
    rng = random.Random(11)
    levels = (1.0, 1.1, 1.5, 2.0, 3.0, 6.0)
    for schedule in all_schedules():
        seed = rng.random()
        makespans = [
            simulate(schedule, random_costs(random.Random(seed), schedule.n_stages, c)).makespan
            for c in levels
        ]
        for low, high in pairwise(makespans):
            assert high >= low - 1e-9, (schedule.name, makespans)


@pytest.mark.parametrize("c", [1.0, 1.3, 2.0, 4.0])
def test_gpipe_makespan_lies_between_alone_and_all_shared(c):
    schedule = generate("gpipe", 2, 8)
    alone = simulate(schedule, CostModel.uniform(2)).makespan
    shared = simulate(schedule, CostModel.uniform(2, contention=c)).makespan
    assert alone - 1e-9 <= shared <= c * alone + 1e-9
    if c > 1:
        # In the steady part both ranks compute, so it must be slower than alone.
        assert shared > alone


def test_deadlock_and_repeated_work_are_reported_as_without_contention():
    costs = CostModel.uniform(2, contention=2.0)
    bad = make([0, 1], 1, {0: "0F0 0B0", 1: "1B0 1F0"}, "bad")
    with pytest.raises(DeadlockError) as shared:
        simulate(bad, costs)
    with pytest.raises(DeadlockError) as fixed:
        simulate(bad, CostModel.uniform(2))
    assert str(shared.value) == str(fixed.value)
    with pytest.raises(ValueError, match="repeats work"):
        simulate(make([0], 2, {0: "0F0 0F1 0F1"}), CostModel.uniform(1, contention=2.0))
    with pytest.raises(ValueError, match=r"for_schedule\(3, 1\)"):
        simulate(generate("gpipe", 3, 3), costs)


@pytest.mark.parametrize("value", [0.5, 0.0, -1.0, math.nan, math.inf])
def test_contention_must_be_finite_and_at_least_one(value):
    with pytest.raises(ValueError, match=r"contention must be a finite number >= 1, got") as info:
        CostModel.uniform(2, contention=value)
    assert str(value) in str(info.value)
    assert "use 1.0" in str(info.value)


def test_split_keeps_contention():
    costs = CostModel.uniform(2, contention=1.75)
    assert costs.split(2).contention == 1.75
    assert costs.for_stages(4).contention == 1.75


def test_json_round_trip_keeps_contention(tmp_path):
    costs = random_costs(random.Random(5), 3, contention=1.0 + 1 / 3)
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    assert json.loads(path.read_text())["contention"] == costs.contention
    loaded = load_costs(path)
    assert loaded == costs
    assert loaded.contention == costs.contention


def test_json_without_contention_loads_as_one():
    doc = costs_to_json(CostModel.uniform(2, contention=3.0))
    del doc["contention"]
    assert costs_from_json(doc).contention == 1.0
    doc["contention"] = None
    assert costs_from_json(doc).contention == 1.0


def test_text_form_reads_contention():
    assert parse_costs("F=1,I=1,W=1,contention=1.6", 2).contention == 1.6
    assert parse_costs("F=1", 2).contention == 1.0
    with pytest.raises(ValueError, match="contention"):
        parse_costs("contention=0.5", 2)


def test_the_gpipe_example_of_the_docs():
    # docs/schedules.md: GPipe, p = 2, m = 4, F = I = W = 1 (B = 2): 15 at c = 1 and
    # 24 at c = 2, the bubble falling from 20% to 12.5%. With c = 2 an action runs at
    # half speed while the other rank computes too:
    #   0F0 alone [0, 1]; then 0F1..0F3 beside 1F0..1F2, 2 each: [1, 7];
    #   1F3 alone [7, 8], 1B0 alone [8, 10] while rank 0 waits for its gradient;
    #   0B0..0B2 beside 1B1..1B3, 4 each: [10, 22]; 0B3 alone [22, 24].
    # Each rank idles 3 of 24 (rank 0 on [7, 10], rank 1 on [0, 1] and [22, 24]).
    schedule = generate("gpipe", 2, 4)
    alone = simulate(schedule, CostModel.uniform(2))
    assert alone.makespan == 15.0 and alone.bubble_ratio == pytest.approx(0.2)
    shared = simulate(schedule, CostModel.uniform(2, contention=2.0))
    assert shared.makespan == 24.0 and shared.bubble_ratio == pytest.approx(0.125)
    assert shared.idle == (3.0, 3.0)
    assert timeline(shared) == [
        (0, "0F0", 0, 1), (0, "0F1", 1, 3), (0, "0F2", 3, 5), (0, "0F3", 5, 7),
        (0, "0B0", 10, 14), (0, "0B1", 14, 18), (0, "0B2", 18, 22), (0, "0B3", 22, 24),
        (1, "1F0", 1, 3), (1, "1F1", 3, 5), (1, "1F2", 5, 7), (1, "1F3", 7, 8),
        (1, "1B0", 8, 10), (1, "1B1", 10, 14), (1, "1B2", 14, 18), (1, "1B3", 18, 22),
    ]  # fmt: skip
    text = " ".join((Path(__file__).parents[1] / "docs" / "schedules.md").read_text().split())
    claim = "GPipe on 2 ranks, 4 micro-batches, `F = I = W = 1` takes 15 at `c = 1` and 24 at"
    assert claim in text
    assert "with the bubble falling from 20% to 12.5%" in text
