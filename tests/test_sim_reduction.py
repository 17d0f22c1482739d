"""The gradient reduction in the simulator: in the background, together, on a shared link."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from twobp.schedule import generate
from twobp.schedule.action import Kind
from twobp.schedule.lowering import add_reductions
from twobp.schedule.two_bp import apply_two_bp
from twobp.sim import simulate
from twobp.sim.costs import CostModel, allreduce_time
from twobp.sim.reduction import reductions_at_end, with_reductions


def test_ring_allreduce_time():
    assert allreduce_time(8.0, 1, 1.0, 0.5) == 0.0
    # 2 (n - 1) steps of latency + bytes / (n * bandwidth): 2 * 3 * (0.5 + 8 / 4)
    assert allreduce_time(8.0, 4, 1.0, 0.5) == pytest.approx(15.0)


def test_a_reduction_runs_beside_the_ranks_work():
    s = add_reductions(generate("1f1b", 2, 2))
    costs = CostModel(
        forward=(1.0, 1.0),
        backward_input=(1.0, 1.0),
        backward_weight=(1.0, 1.0),
        reduce=(5.0, 5.0),
    )
    result = simulate(s, costs)
    spans = {str(x.action): x for x in result.spans}
    # Rank 1 ends its work at 7 and reduces from its last B on, rank 0 at 8: the step ends at 13.
    assert spans["1R0-1"].start == spans["1B1"].end
    assert spans["0R0-1"].end == pytest.approx(spans["0B1"].end + 5.0)
    assert result.makespan == pytest.approx(spans["0B1"].end + 5.0)
    # Busy time counts compute only: the reduction is idle time of the rank.
    assert result.busy == (6.0, 6.0)


def test_replicas_in_the_schedule_reduce_together_and_share_a_link():
    s = apply_two_bp(generate("chimera", 2, 4), "paper")
    fitted = CostModel.uniform(2).for_schedule(s.n_stages, s.n_pipelines)
    replicated, timed = with_reductions(s, fitted, data_parallel=1)
    assert timed.reduce == (0.0,) * 4  # no parameter bytes: free
    timed = CostModel(
        forward=fitted.forward,
        backward_input=fitted.backward_input,
        backward_weight=fitted.backward_weight,
        reduce=(4.0,) * 4,
    )
    result = simulate(replicated, timed)
    r = {x.action.stage: x for x in result.spans if x.action.kind is Kind.REDUCE}
    # Stage 0 and its replica stage 2 end together, as do 1 and 3.
    assert r[0].end == r[2].end and r[1].end == r[3].end
    assert min(r[0].end, r[1].end) >= max(r[0].start, r[2].start) + 4.0
    at_end = simulate(reductions_at_end(replicated), timed)
    # At the end both all-reduces of a rank share its link: 8 after the last W.
    last = max(x.end for x in at_end.spans if x.action.kind is not Kind.REDUCE)
    assert at_end.makespan == pytest.approx(last + 8.0)
    assert result.makespan <= at_end.makespan


def test_with_reductions_over_copies_times_the_gradient_bytes():
    s = generate("1f1b", 2, 4)
    costs = CostModel.uniform(2, parameter_bytes=8.0, bandwidth=1.0)
    same, untouched = with_reductions(s, costs, data_parallel=1)
    assert same is s and untouched is costs
    replicated, timed = with_reductions(s, costs, data_parallel=4)
    assert timed.reduce == (pytest.approx(allreduce_time(8.0, 4, 1.0, 0.0)),) * 2
    assert sum(a.kind is Kind.REDUCE for acts in replicated.actions.values() for a in acts) == 2
    assert math.isfinite(simulate(replicated, timed).makespan)
    with pytest.raises(ValueError, match="data_parallel must be >= 1"):
        with_reductions(s, costs, data_parallel=0)


def test_an_all_reduce_goes_at_its_own_measured_bandwidth():
    # Summing and copying make a CPU all-reduce slower than a message of the same size.
    s = generate("1f1b", 2, 4)
    costs = CostModel.uniform(2, parameter_bytes=8.0, bandwidth=4.0, reduce_bandwidth=1.0)
    _, timed = with_reductions(s, costs, data_parallel=2)
    assert timed.reduce == (pytest.approx(allreduce_time(8.0, 2, 1.0, 0.0)),) * 2
    _, at_link = with_reductions(s, replace(costs, reduce_bandwidth=None), data_parallel=2)
    assert at_link.reduce == (pytest.approx(allreduce_time(8.0, 2, 4.0, 0.0)),) * 2


def test_a_sharded_optimizer_reduce_scatters_gathers_and_holds_a_share_of_its_state():
    costs = CostModel.uniform(4, parameter_bytes=10, optimizer_bytes=16, bandwidth=10.0)
    schedule = apply_two_bp(generate("1f1b", 4, 8), "paper")
    plain_schedule, plain = with_reductions(schedule, costs, 8)
    sharded_schedule, sharded = with_reductions(schedule, replace(costs, shard_optimizer=True), 8)
    assert sharded.reduce[0] == pytest.approx(plain.reduce[0] / 2)
    assert sharded.gather[0] == pytest.approx(plain.reduce[0] / 2)
    assert sharded.optimizer_bytes == (2.0,) * 4
    unsharded, zero = simulate(plain_schedule, plain), simulate(sharded_schedule, sharded)
    assert unsharded.gather_wait == 0
    # Stage 0 starts the step: its first F waits for its whole gather.
    assert zero.gather_wait == pytest.approx(sharded.gather[0])
    assert zero.makespan <= unsharded.makespan + 1e-12
    assert max(unsharded.peak_memory) - max(zero.peak_memory) == pytest.approx(16 - 2)


def test_a_first_forward_runs_each_block_once_its_parameters_are_gathered():
    costs = replace(CostModel.uniform(4, parameter_bytes=10, bandwidth=10.0), shard_optimizer=True)
    schedule = apply_two_bp(generate("1f1b", 4, 8), "paper")
    replicated, timed = with_reductions(schedule, costs, 8)
    gather, forward = timed.gather[0], timed.forward[0]
    assert gather < forward
    whole = simulate(replicated, timed)
    blocks = simulate(replicated, replace(timed, gather_pieces=4))
    assert whole.gather_wait == pytest.approx(gather)
    # Block k runs once the k-th quarter has arrived: only the last quarter is waited for.
    assert blocks.gather_wait == pytest.approx(gather / 4)
    assert blocks.makespan == pytest.approx(whole.makespan - 3 * gather / 4)
    # A gather longer than the forward: the forward ends a block after the gather.
    slow = replace(timed, gather=(3 * forward,) * 4, gather_pieces=4)
    assert simulate(replicated, slow).gather_wait == pytest.approx(
        3 * forward + forward / 4 - forward
    )
    with pytest.raises(ValueError, match="gather_pieces"):
        replace(timed, gather_pieces=0)
