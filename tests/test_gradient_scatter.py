"""Where a sharded stage's gradients are reduce-scattered: the rule, as data."""

from twobp.schedule.action import Action
from twobp.schedule.gradient_scatter import (
    lowers_peak,
    scatter_points,
    scattered_each_w,
    scatters_at_reduce,
)


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
