"""The simulator's model of the dynamic 2BP policy and of jittered action times."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from twobp.schedule import Action, Kind, apply_two_bp, generate, prepare
from twobp.schedule._timing import make_timing
from twobp.sim import CostModel, simulate
from twobp.sim.result import jittered, simulated
from twobp.sim.simulate import JITTER_DRAWS


def _costs(n_stages: int) -> CostModel:
    one = (1.0,) * n_stages
    return CostModel(forward=one, backward_input=one, backward_weight=(0.8,) * n_stages)


def _makespan(schedule: str, policy: str, costs: CostModel, m: int = 8) -> float:
    s = prepare(schedule, n_ranks=4, n_microbatches=m, two_bp=True, policy=policy, costs=costs)
    return simulate(s, costs).makespan


def test_without_jitter_dynamic_places_w_as_fill_does():
    costs = _costs(4)
    dynamic = prepare("1f1b", n_ranks=4, n_microbatches=8, two_bp=True, policy="dynamic")
    # The list has every W at the end; the walk places them in the waits.
    assert simulate(dynamic, costs).makespan == pytest.approx(_makespan("1f1b", "fill", costs))
    assert _makespan("1f1b", "fill", costs) < _makespan("1f1b", "eager", costs)


def test_dynamic_keeps_the_memory_bound_of_its_list():
    costs = replace(_costs(4), activation_bytes=(1.0,) * 4, weight_grad_bytes=(1.0,) * 4)
    unbounded = prepare("1f1b", n_ranks=4, n_microbatches=8, two_bp=True, policy="dynamic")
    bounded = prepare(
        "1f1b", n_ranks=4, n_microbatches=8, two_bp=True, policy="dynamic", costs=costs
    )
    # The same list with W forced in (a memory limit of 4 micro-batches per rank).
    limited = apply_two_bp(generate("1f1b", 4, 8), "dynamic", memory_limit=4)
    assert max(simulate(limited, costs).peak_memory) <= max(simulate(bounded, costs).peak_memory)
    assert max(simulate(limited, costs).peak_memory) < max(simulate(unbounded, costs).peak_memory)


def test_jitter_draws_each_action_once_around_its_cost():
    costs = _costs(4)
    s = prepare("1f1b", n_ranks=4, n_microbatches=8, two_bp=True, policy="paper")
    timing = make_timing(costs, s)
    a = Action.make(1, Kind.FORWARD, 3)
    one, again = jittered(timing, 0.3, 7), jittered(timing, 0.3, 7)
    assert one.duration(a) == again.duration(a)  # one draw per action and seed
    assert one.duration(a) != jittered(timing, 0.3, 8).duration(a)
    draws = [jittered(timing, 0.3, k).duration(a) for k in range(400)]
    assert statistics.mean(draws) == pytest.approx(1.0, abs=0.05)
    assert statistics.stdev(draws) == pytest.approx(0.3, abs=0.05)
    assert min(draws) >= 0.1
    with pytest.raises(ValueError, match="jitter must be a finite fraction"):
        replace(costs, jitter=-0.1)


def test_under_jitter_dynamic_beats_the_placements_planned_on_expected_times():
    """paper and fill place W on the expected times, dynamic on the drawn ones (eager
    places none: the model puts a W in a wait only where all of it fits, so eager,
    whose W never wait for a slot, may come out ahead on short waits)."""
    base = _costs(4)
    mean = {
        policy: statistics.mean(
            _makespan("1f1b", policy, replace(base, jitter=0.3, jitter_seed=k), m=16)
            for k in range(0, 45, 9)
        )
        for policy in ("paper", "fill", "dynamic")
    }
    assert mean["dynamic"] < min(mean["paper"], mean["fill"])
    # Without jitter it is no worse than fill.
    assert _makespan("1f1b", "dynamic", base, 16) <= _makespan("1f1b", "fill", base, 16) + 1e-9


def test_the_text_form_of_costs_takes_jitter_and_its_seed():
    from twobp.sim.cost_io import parse_costs

    costs = parse_costs("F=1,I=1,W=0.8,jitter=0.2,seed=4", 2)
    assert (costs.jitter, costs.jitter_seed) == (0.2, 4)
    assert parse_costs("F=1", 2).jitter == 0.0
    with pytest.raises(ValueError, match="jitter must be a finite fraction"):
        parse_costs("jitter=-1", 2)


def test_a_jittered_simulation_is_the_draw_of_median_step():
    costs = replace(_costs(4), jitter=0.2, jitter_seed=5)
    s = prepare("1f1b", n_ranks=4, n_microbatches=8, two_bp=True, policy="paper")
    draws = sorted(
        simulated(s, replace(costs, jitter_seed=5 + k)).makespan for k in range(JITTER_DRAWS)
    )
    assert simulate(s, costs).makespan == draws[len(draws) // 2]
    assert draws[0] < draws[-1]


def test_a_concatenated_w_draws_as_its_micro_batches_one_by_one():
    # W over micro-batches 2 and 3 together takes the mean of their own draws: a schedule
    # that runs them together and one that runs them apart meet the same work.
    costs = _costs(4)
    s = prepare("1f1b", n_ranks=4, n_microbatches=8, two_bp=True, policy="paper")
    drawn = jittered(make_timing(costs, s), 0.3, 3)
    both = drawn.duration(Action.make(2, Kind.BACKWARD_WEIGHT, (2, 3)))
    apart = [drawn.duration(Action.make(2, Kind.BACKWARD_WEIGHT, mb)) for mb in (2, 3)]
    assert apart[0] != apart[1]
    assert both == pytest.approx(sum(apart))
