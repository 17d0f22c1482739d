"""The simulator on small schedules written by hand, checked against closed forms."""

import dataclasses

import pytest

from twobp.schedule import generate
from twobp.schedule.action import Action
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.memory import (
    least_fill_memory,
    memory_timeline,
    microbatch_limit,
    peak_memory,
)
from twobp.sim.simulate import DeadlockError, simulate


def make(placement, m, rows, name="hand"):
    return Schedule(
        tuple(placement),
        m,
        {r: tuple(Action.parse(t) for t in row.split()) for r, row in rows.items()},
        name,
    )


def gpipe(p, m, split=False):
    """All forwards, then all backwards in micro-batch order; one stage per rank."""
    rows = {}
    for r in range(p):
        back = [f"{r}I{k} {r}W{k}" if split else f"{r}B{k}" for k in range(m)]
        rows[r] = " ".join([f"{r}F{k}" for k in range(m)] + back)
    return make(range(p), m, rows, "gpipe")


def one_f_one_b(p, m):
    """PipeDream-flush 1F1B with fused backward; one stage per rank."""
    rows = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [f"{r}F{k}" for k in range(warmup)]
        for k in range(m - warmup):
            order += [f"{r}F{warmup + k}", f"{r}B{k}"]
        order += [f"{r}B{k}" for k in range(m - warmup, m)]
        rows[r] = " ".join(order)
    return make(range(p), m, rows, "1f1b")


# F = 1 and fused B = I + W = 2, so B = 2F as in the classic bubble formula.
UNIT = dict(f=1, i=1, w=1)


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_classic_bubble_ratio(builder, p, m):
    # Each rank works m * (F + B) = 3m and the pipeline fills and drains in
    # (p - 1) * (F + B), so makespan = 3 (m + p - 1) and bubble = (p-1)/(m+p-1).
    result = simulate(builder(p, m), CostModel.uniform(p, **UNIT))
    assert result.makespan == pytest.approx(3 * (m + p - 1))
    assert result.busy == pytest.approx((3 * m,) * p)
    assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    for r in range(p):
        assert result.bubble_ratios[r] == pytest.approx((p - 1) / (m + p - 1))
        assert result.idle[r] == pytest.approx(3 * (p - 1))


def test_gpipe_spans_exactly():
    result = simulate(gpipe(2, 2), CostModel.uniform(2, **UNIT))
    got = [(s.rank, str(s.action), s.start, s.end) for s in result.spans]
    assert got == [
        (0, "0F0", 0, 1),
        (0, "0F1", 1, 2),
        (0, "0B0", 5, 7),
        (0, "0B1", 7, 9),
        (1, "1F0", 1, 2),
        (1, "1F1", 2, 3),
        (1, "1B0", 3, 5),
        (1, "1B1", 5, 7),
    ]


def test_split_backward_with_weights_in_place_matches_fused():
    fused = simulate(gpipe(3, 4), CostModel.uniform(3, **UNIT))
    split = simulate(gpipe(3, 4, split=True), CostModel.uniform(3, **UNIT))
    # I;W right after each other on one rank take as long as B, but the
    # gradient leaves after I, so the split pipeline drains sooner.
    assert split.makespan < fused.makespan
    assert sum(split.busy) == pytest.approx(sum(fused.busy))


def test_transfer_time_delays_only_cross_rank_dependencies():
    costs = CostModel.uniform(2, f=1, i=1, w=1, send_latency=0.5)
    # F0 on rank 0 [0,1]; arrives at 1.5; rank 1 F0 [1.5,2.5], B0 [2.5,4.5];
    # gradient arrives at 5; rank 0 B0 [5,7].
    result = simulate(make([0, 1], 1, {0: "0F0 0B0", 1: "1F0 1B0"}), costs)
    assert result.makespan == pytest.approx(7.0)
    # Two stages on one rank: no transfer.
    result = simulate(make([0, 0], 1, {0: "0F0 1F0 1B0 0B0"}), costs)
    assert result.makespan == pytest.approx(6.0)
    assert result.bubble_ratio == 0.0


def test_send_overhead_holds_the_sender_and_delays_the_transfer():
    costs = CostModel.uniform(2, f=1, i=1, w=1, send_latency=0.5, send_overhead=0.25)
    # F0 on rank 0 [0,1.25] (sends); arrives at 1.75; rank 1 F0 [1.75,2.75] (last
    # stage: nothing crosses), B0 [2.75,5] (sends); arrives at 5.5; rank 0 B0 [5.5,7.5]
    # (stage 0: nothing crosses).
    result = simulate(make([0, 1], 1, {0: "0F0 0B0", 1: "1F0 1B0"}), costs)
    assert [str(s.action) for s in result.spans] == ["0F0", "0B0", "1F0", "1B0"]
    times = [t for s in result.spans for t in (s.start, s.end)]
    assert times == pytest.approx([0, 1.25, 5.5, 7.5, 1.75, 2.75, 2.75, 5.0])
    # Two stages on one rank send nothing: no overhead.
    result = simulate(make([0, 0], 1, {0: "0F0 1F0 1B0 0B0"}), costs)
    assert result.makespan == pytest.approx(6.0)


def test_send_overhead_counts_each_crossing_of_a_v():
    # Stages 0 and 3 on rank 0, 1 and 2 on rank 1: of the forward results, those
    # of stages 0 and 2 cross (1 -> 2 stays on rank 1); of the input gradients,
    # those of stages 3 and 1. Four sends per micro-batch.
    schedule = generate("zb-v", 2, 2)
    plain = simulate(schedule, CostModel.uniform(4, **UNIT))
    costly = simulate(schedule, CostModel.uniform(4, **UNIT, send_overhead=0.5))
    assert sum(costly.busy) == pytest.approx(sum(plain.busy) + 0.5 * 4 * 2)
    assert costly.makespan > plain.makespan


def test_bandwidth_counts_bytes():
    costs = CostModel.uniform(2, send_bytes=200.0, bandwidth=100.0)
    result = simulate(make([0, 1], 1, {0: "0F0 0B0", 1: "1F0 1B0"}), costs)
    assert result.makespan == pytest.approx(6.0 + 2 * 2.0)


def test_concatenated_weight_uses_table():
    costs = CostModel.uniform(1, weight_concat={1: 1.0, 2: 1.5})
    result = simulate(make([0], 2, {0: "0F0 0F1 0I0 0I1 0W0-1"}), costs)
    assert result.makespan == pytest.approx(4 + 1.5)


def test_communication_markers_take_no_time():
    rows = {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    result = simulate(make([0, 1], 1, rows), CostModel.uniform(2, **UNIT))
    assert result.makespan == pytest.approx(6.0)
    assert len(result.spans) == 4


def test_deadlock_names_rank_action_and_wait():
    rows = {0: "0F0 0B0", 1: "1B0 1F0"}
    with pytest.raises(DeadlockError) as info:
        simulate(make([0, 1], 1, rows, "bad"), CostModel.uniform(2))
    text = str(info.value)
    assert "rank 1 is stuck at 1B0 (its action #0): waits for 1F0 (rank 1, its action #1" in text
    assert (
        "rank 0 is stuck at 0B0 (its action #1): waits for 1I0 or 1B0 or 1IR0 "
        "(rank 1, its action #0" in text
    )


def test_deadlock_on_missing_action():
    with pytest.raises(DeadlockError, match=r"0I1 or 0B1 or 0IR1, which no rank lists"):
        simulate(make([0], 2, {0: "0F0 0F1 0I0 0W0-1"}), CostModel.uniform(1))


def test_repeated_work_is_an_error():
    with pytest.raises(ValueError, match="repeats work"):
        simulate(make([0], 2, {0: "0F0 0F1 0I0 0I1 0W0-1 0W1"}), CostModel.uniform(1))
    # A fused B already made the weight gradient: a W of the same micro-batch repeats it.
    with pytest.raises(ValueError, match=r"repeats work .* \(micro-batch 0 of stage 0\)"):
        simulate(make([0], 1, {0: "0F0 0B0 0W0"}), CostModel.uniform(1))


def test_cost_model_must_match_stage_count():
    with pytest.raises(ValueError, match=r"for_schedule\(2, 1\)"):
        simulate(gpipe(2, 1), CostModel.uniform(3))


@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 8), (2, 3)])
def test_peak_memory_gpipe_holds_all_one_f_one_b_holds_p_minus_rank(p, m):
    costs = CostModel.uniform(p, weight_grad_bytes=0.0, parameter_bytes=10.0)
    assert simulate(gpipe(p, m), costs).peak_memory == tuple(10.0 + m for _ in range(p))
    assert simulate(one_f_one_b(p, m), costs).peak_memory == tuple(
        10.0 + min(p - r, m) for r in range(p)
    )


def test_delayed_weight_pass_keeps_memory_until_it_runs():
    # One stage, three micro-batches, all W at the end: I turns 1 unit of
    # activations into 1 unit of stored derivatives, freed only by the W.
    schedule = make([0], 3, {0: "0F0 0I0 0F1 0I1 0F2 0I2 0W0-2"})
    result = simulate(schedule, CostModel.uniform(1))
    assert result.peak_memory == (3.0,)
    points = memory_timeline(result.spans, CostModel.uniform(1), (0,))[0]
    assert points[-1] == (9.0, 0.0)  # 6 of F and I, then W over 3
    # Running W right after each I frees it at once.
    eager = make([0], 3, {0: "0F0 0I0 0W0 0F1 0I1 0W1 0F2 0I2 0W2"})
    assert simulate(eager, CostModel.uniform(1)).peak_memory == (1.0,)


def test_peak_memory_frees_before_allocating_at_same_instant():
    schedule = make([0], 2, {0: "0F0 0B0 0F1 0B1"})
    spans = simulate(schedule, CostModel.uniform(1)).spans
    assert peak_memory(spans, CostModel.uniform(1), (0,)) == (1.0,)


def test_microbatch_limit_reads_parameters_and_the_largest_stage():
    from twobp.sim.costs import CostModel

    schedule = generate("interleaved-1f1b", 2, 4, stages_per_rank=2)
    costs = CostModel(
        forward=(1, 1, 1, 1),
        backward_input=(1, 1, 1, 1),
        backward_weight=(1, 1, 1, 1),
        activation_bytes=(10, 30, 10, 10),
        weight_grad_bytes=(20, 5, 5, 5),
        parameter_bytes=(100, 0, 50, 0),
    )
    # Rank 0 has stages 0 and 2: 150 fixed, 20 per micro-batch -> (250 - 150) // 20 = 5.
    # Rank 1 has stages 1 and 3: 0 fixed, 30 per micro-batch -> 250 // 30 = 8.
    assert microbatch_limit(schedule, costs, 250) == 5
    assert microbatch_limit(schedule, costs, 140) == 0
    # Nothing held per micro-batch: every micro-batch fits, once the parameters do.
    free = dataclasses.replace(costs, activation_bytes=(0,) * 4, weight_grad_bytes=(0,) * 4)
    assert microbatch_limit(schedule, free, 150) == 4
    assert microbatch_limit(schedule, free, 149) == 0


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_least_fill_memory_is_where_fill_starts_to_fit(name, v):
    from twobp.schedule import apply_two_bp
    from twobp.sim.cost_io import parse_costs

    schedule = generate(name, 4, 8, stages_per_rank=v)
    costs = parse_costs("F=1,I=1,W=1,param=0.25", 4).for_stages(schedule.n_stages)
    need = least_fill_memory(schedule, costs)
    held = microbatch_limit(schedule, costs, need)
    apply_two_bp(schedule, "fill", costs=costs, memory_limit=held)
    with pytest.raises(ValueError, match="is below what rank"):
        held = microbatch_limit(schedule, costs, need - 0.01)
        apply_two_bp(schedule, "fill", costs=costs, memory_limit=held)
