"""Properties of simulated timelines over generated schedules and random costs.

The dependency rules are checked with the schedule layer's own
``twobp.schedule.dependencies`` as the oracle, not with the simulator's.
"""

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twobp.schedule import SCHEDULES, add_communication, apply_two_bp, generate
from twobp.schedule.dependencies import produces, requires
from twobp.sim.costs import CostModel
from twobp.sim.simulate import simulate

times = st.floats(min_value=0.1, max_value=5.0, allow_nan=False)


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    p = draw(st.integers(1, 4))
    m = p * draw(st.integers(1, 3))  # a multiple of p suits every schedule
    if name in ("chimera", "dualpipe"):  # two pipelines: p and m even
        p, m = 2 * ((p + 1) // 2), 2 * m
    if name.startswith("dualpipe"):  # m >= 2p
        m = max(m, 2 * p)
    policy = draw(st.sampled_from([None, "eager", "paper", "fill"]))
    schedule = apply_two_bp(generate(name, p, m), policy)
    n = schedule.n_stages
    costs = CostModel(
        forward=tuple(draw(st.lists(times, min_size=n, max_size=n))),
        backward_input=tuple(draw(st.lists(times, min_size=n, max_size=n))),
        backward_weight=tuple(draw(st.lists(times, min_size=n, max_size=n))),
        send_latency=draw(st.sampled_from([0.0, 0.05, 0.5])),
    )
    return schedule, costs


@settings(max_examples=60, deadline=None)
@given(cases())
def test_timeline_respects_order_dependencies_and_costs(case):
    schedule, costs = case
    result = simulate(schedule, costs)
    end_of = {}
    for span in result.spans:
        for key in produces(span.action):
            end_of[key] = span.end
    for rank in schedule.actions:
        own = [s for s in result.spans if s.rank == rank]
        # The rank runs its list in order, one action at a time.
        assert [s.action for s in own] == list(schedule.actions[rank])
        for before, after in pairwise(own):
            assert after.start >= before.end - 1e-9
        for span in own:
            assert span.duration == pytest.approx(costs.duration(span.action))
            for stage, tag, mb in requires(span.action, schedule.graph, lowered=False):
                # A result from another rank arrives after the transfer.
                delay = 0.0 if schedule.placement[stage] == rank else costs.send_latency
                assert span.start >= end_of[(stage, tag, mb)] + delay - 1e-9
    total = sum(costs.duration(a) for acts in schedule.actions.values() for a in acts)
    assert sum(result.busy) == pytest.approx(total)
    assert result.makespan >= max(result.busy) - 1e-9
    assert all(0 <= b <= 1 for b in result.bubble_ratios)


@settings(max_examples=25, deadline=None)
@given(cases())
def test_communication_markers_do_not_change_the_timeline(case):
    schedule, costs = case
    plain = simulate(schedule, costs)
    lowered = simulate(add_communication(schedule), costs)
    assert lowered.spans == plain.spans
