"""recompute="auto": the fewest stashes rebuilt to fit a memory limit, and the planner's ranking."""

from __future__ import annotations

from itertools import combinations, product

import pytest

from twobp.schedule.rebuild import mark_rebuilds, rebuilt_microbatches
from twobp.sim import CostModel, simulate
from twobp.sim.candidate import build_schedule, describe
from twobp.sim.rebuild import RebuildError, fewest_rebuilds, rebuild_count
from twobp.sim.search import auto_options, choose, search

# A stash and a micro-batch's activations 1 each; what crosses a boundary 0.25, so a
# rebuilt stash keeps 0.5 (its stage's input and output gradient).
COSTS = CostModel.uniform(2, send_bytes=0.25)


def _one_f1b(n_mb: int = 4):
    return build_schedule("1f1b", 2, n_mb, None, "paper", COSTS)


def test_a_schedule_that_fits_is_kept_whole():
    schedule, costs = _one_f1b()
    assert max(simulate(schedule, costs).peak_memory) == 4.0  # every stash at the end
    assert fewest_rebuilds(schedule, costs, 4.0) is schedule


@pytest.mark.parametrize(("limit", "count"), [(3.5, 2), (3.0, 4)])
def test_the_fewest_rebuilds_that_fit(limit, count):
    schedule, costs = _one_f1b()
    chosen = fewest_rebuilds(schedule, costs, limit)
    assert max(simulate(chosen, costs).peak_memory) <= limit
    assert rebuild_count(chosen) == count
    # By hand: each rank holds its 4 stashes at its peak; one rebuilt saves 0.5 there.
    # No fewer fit, wherever their WR runs (in place of the W or last).
    pairs = [(s, m) for s in range(2) for m in range(4)]
    for fewer in combinations(pairs, count - 1):
        for last in product((False, True), repeat=len(fewer)):
            rebuilt: dict[int, list[int]] = {}
            for s, m in fewer:
                rebuilt.setdefault(s, []).append(m)
            trial = mark_rebuilds(
                schedule, rebuilt, [p for p, at_end in zip(fewer, last, strict=True) if at_end]
            )
            assert max(simulate(trial, costs).peak_memory) > limit, (fewer, last)


def test_the_rebuilt_are_those_held_longest():
    schedule, costs = _one_f1b()
    chosen = fewest_rebuilds(schedule, costs, 3.5)
    # The last stage's first stash waits longest for the concatenated W at the end.
    assert rebuilt_microbatches(chosen) == {0: (1,), 1: (0,)}
    assert " ".join(map(str, chosen.actions[1])).endswith("1W1-3 1WR0")


def test_what_cannot_fit_is_named():
    schedule, costs = _one_f1b()
    with pytest.raises(RebuildError, match=r"rank \d needs 3 with 4 stashes rebuilt, over "):
        fewest_rebuilds(schedule, costs, 2.5)


def test_the_planner_rebuilds_when_keeping_every_stash_does_not_fit():
    costs = CostModel.uniform(4, send_bytes=0.05)
    limit = 7.5  # every rank holds 8 stashes under paper; eager holds few, but idles more
    # (fill, which runs W earlier within the limit, is faster still: see the next test.)
    space = {"schedules": ["1f1b"], "policies": ["eager", "paper"]}
    kept = choose(search(auto_options(8, **space), 4, 8, costs, limit), limit)
    assert kept.policy == "eager" and kept.rebuilds == 0
    ranking = search(auto_options(8, **space, recompute="auto"), 4, 8, costs, limit)
    best = choose(ranking, limit)
    assert best.policy == "paper" and best.rebuilds == 4, describe(best)
    assert best.makespan < kept.makespan and best.peak_memory <= limit
    assert describe(best) == "1f1b with 2BP (paper), recompute='auto' (4 rebuilt)"
    # What fits without a rebuild is ranked as it is.
    same = next(c for c in ranking if (c.policy, c.microbatches_per_w) == (kept.policy, None))
    assert same.rebuilds == 0 and same.makespan == kept.makespan


def test_rebuilding_is_ranked_against_moving_w_earlier():
    costs = CostModel.uniform(4, send_bytes=0.05)
    ranking = search(auto_options(8, schedules=["1f1b"], recompute="auto"), 4, 8, costs, 7.5)
    best = choose(ranking, 7.5)
    # fill places W where the limit lets it, at no cost: faster than paper's rebuilds.
    assert best.policy == "fill" and best.rebuilds == 0
    # paper over the limit is no faster even before a rebuild: it is not searched.
    paper = [c for c in ranking if c.policy == "paper"]
    assert paper and all("rebuilding cannot make it the fastest" in c.error for c in paper)


def test_auto_without_a_limit_is_refused():
    ranking = search(auto_options(4, schedules=["1f1b"], recompute="auto"), 2, 4, COSTS)
    assert all("give memory_limit" in c.error for c in ranking)
