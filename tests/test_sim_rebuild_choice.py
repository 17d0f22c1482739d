"""recompute="auto" on a schedule by name: the default where it fits, else the fastest that fits."""

from __future__ import annotations

import pytest

from twobp.schedule import prepare
from twobp.sim import CostModel, simulate
from twobp.sim.candidate import fit_costs, timed_costs
from twobp.sim.rebuild import RebuildError, fewest_rebuilds, rebuild_count
from twobp.sim.rebuild_choice import rebuild_to_fit


def _costs(fused_backward: float = 2.0) -> CostModel:
    """Unit F, I and W on 2 stages; a stash and a micro-batch's activations 1 each, what
    crosses a boundary 0.25 (a rebuilt stash keeps 0.5); a fused B as given."""
    return CostModel.uniform(2, b=fused_backward, send_bytes=0.25)


def _schedule(two_bp: bool | tuple[bool, ...], costs: CostModel, name: str = "1f1b"):
    """What Pipeline(name, 4 micro-batches, two_bp=..., costs=costs) runs on 2 ranks."""
    return prepare(name, n_ranks=2, n_microbatches=4, two_bp=two_bp, costs=costs)


def _predicted(schedule, costs: CostModel):
    return simulate(schedule, timed_costs(schedule, fit_costs(costs.for_stages, schedule)))


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("two_bp", [True, False, (False, True)])
def test_a_default_that_fits_runs_unchanged(name, two_bp):
    costs = _costs()
    default = _schedule(two_bp, costs, name)
    peak = max(_predicted(default, costs).peak_memory)
    everything = [_schedule(split, costs, name) for split in (False, (False, True), True)]
    for limit in (peak, 10 * peak):
        choice = rebuild_to_fit(default, costs, limit, fewer_split=everything)
        assert choice.schedule is default and choice.rebuilds == 0, (limit, choice.summary())
        assert (choice.peak, choice.chosen_peak) == (peak, peak)
        assert "nothing rebuilt" in choice.summary()
    # The other contenders are not even built where the default fits.
    assert rebuild_to_fit(default, costs, peak, fewer_split=_unread()).schedule is default


def _unread():
    raise AssertionError("fewer_split was read though the default fits")
    yield


def test_a_default_that_fits_stays_though_fusing_is_predicted_faster():
    # A fused B much cheaper than I + W: fused is predicted faster, and also fits.
    costs = _costs(fused_backward=1.0)
    split, fused = _schedule(True, costs), _schedule(False, costs)
    assert _predicted(fused, costs).makespan < _predicted(split, costs).makespan
    choice = rebuild_to_fit(split, costs, 4.0, fewer_split=[fused])
    assert choice.schedule is split


@pytest.mark.parametrize(("limit", "count"), [(3.5, 2), (3.0, 4)])
def test_over_the_limit_the_fewest_stashes_are_rebuilt(limit, count):
    costs = _costs()
    default = _schedule(True, costs)
    choice = rebuild_to_fit(default, costs, limit)
    timed = timed_costs(default, fit_costs(costs.for_stages, default))
    assert choice.schedule == fewest_rebuilds(default, timed, limit)
    assert choice.rebuilds == count and choice.peak == 4.0
    after = _predicted(choice.schedule, costs)
    assert choice.chosen_peak == max(after.peak_memory) <= limit
    assert choice.chosen_step == after.makespan > choice.step
    assert f"{count} stashes rebuilt" in choice.summary()


@pytest.mark.parametrize(
    ("fused_backward", "limit", "fused_wins"),
    [(2.0, 3.0, True), (1.0, 3.5, True), (3.0, 3.5, False), (3.0, 3.0, False)],
)
def test_over_the_limit_the_fastest_that_fits_runs(fused_backward, limit, fused_wins):
    # Where the pipeline chose the split stages, splitting fewer is a contender.
    costs = _costs(fused_backward)
    default, fused = _schedule(True, costs), _schedule(False, costs)
    choice = rebuild_to_fit(default, costs, limit, fewer_split=[fused])
    rebuilt = _predicted(rebuild_to_fit(default, costs, limit).schedule, costs).makespan
    kept = _predicted(fused, costs).makespan
    assert (choice.schedule is fused) is fused_wins, (rebuilt, kept)
    assert choice.alternative == (0 if fused_wins else None)
    assert choice.chosen_step == min(rebuilt, kept) and choice.chosen_peak <= limit
    if fused_wins:
        assert "1f1b instead, 0 stashes rebuilt" in choice.summary()
    else:
        assert rebuild_count(choice.schedule) > 0


def test_what_nothing_fits_is_named():
    costs = _costs()
    default, fused = _schedule(True, costs), _schedule(False, costs)
    with pytest.raises(RebuildError, match=r"rank \d needs 3 with 4 stashes rebuilt"):
        rebuild_to_fit(default, costs, 2.5)
    # A fused schedule that fits is taken rather than an error.
    kept = rebuild_to_fit(default, costs, 2.5, fewer_split=[default, fused])
    assert kept.schedule is fused and kept.alternative == 1
    with pytest.raises(RebuildError, match=r"over memory_limit=1\.5"):
        rebuild_to_fit(default, costs, 1.5, fewer_split=[fused])
