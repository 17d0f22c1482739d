"""Where a sharded stage's gradients are reduce-scattered: the rule, as data."""

from twobp.schedule.action import Action
from twobp.schedule.gradient_scatter import (
    lowers_peak,
    scatter_points,
    scattered_each_w,
    scattered_each_w_by_rank,
    scatters_at_reduce,
)
from twobp.schedule.schedule import Schedule


def _acts(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


def test_steady_state_w_can_lower_the_peak_and_back_to_back_w_cannot():
    steady = _acts("0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2 0R0-2")
    end = _acts("0F0 0F1 0I0 0F2 0I1 0I2 0W0 0W1 0W2 0R0-2")
    assert lowers_peak(steady, 0) and not lowers_peak(end, 0)
    assert scattered_each_w(steady, None) == {0} and scattered_each_w(end, None) == set()
    assert scattered_each_w(end, True) == {0} and scattered_each_w(steady, False) == set()


def test_points_and_the_r_that_still_scatters():
    acts = _acts("0F0 1F0 1B0 0I0 0W0 1R0 0R0")
    assert scatter_points(acts, frozenset({0, 1})) == {2: 1, 4: 0}
    # Stage 0 scattered after its W; stage 1's B too; a stage not scattering each W at R.
    assert scatters_at_reduce(acts, frozenset({0, 1})) == set()
    assert scatters_at_reduce(acts, frozenset({0})) == {1}
    # A B after the last W is scattered after it too: R has nothing left to send.
    late_b = _acts("0F0 0F1 0I0 0W0 0B1 0R0-1")
    assert scatters_at_reduce(late_b, frozenset({0})) == set()


def test_two_pipelines_scatter_each_w_only_where_every_holder_lists_as_many_w():
    # Chimera on 2 ranks under 2BP, as twobp runs it: model stage 0 (stages 0 and 2) has
    # one W on each holder, model stage 1 (stages 1 and 3) one on rank 0 and two on rank 1.
    chimera = Schedule(
        placement=(0, 1, 1, 0),
        n_microbatches=4,
        actions={
            0: _acts("0F0 0F1 3F2 3I2 0I0 0I1 3F3 3I3 3W2-3 3R2-3 0W0-1 0R0-1"),
            1: _acts("2F2 1F0 1I0 1F1 1I1 2F3 2I2 1W0 2I3 2W2-3 2R2-3 1W1 1R0-1"),
        },
        n_pipelines=2,
    )
    assert scattered_each_w_by_rank(chimera, True) == {0: {0}, 1: {2}}
    # Rank 1 alone would scatter stage 1 after each W (an I lies between its W): not paired.
    assert scattered_each_w(chimera.actions[1], None) == {1}
    assert scattered_each_w_by_rank(chimera, None) == {0: set(), 1: set()}
    assert scattered_each_w_by_rank(chimera, False) == {0: set(), 1: set()}
    one = Schedule((0,), 2, {0: _acts("0F0 0I0 0W0 0F1 0I1 0W1 0R0-1")})
    assert scattered_each_w_by_rank(one, True) == {0: {0}}
