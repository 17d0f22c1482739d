"""The 2BP transform: exact placements, policies, memory limit, errors."""

import itertools

import pytest

from twobp.schedule import (
    TWO_BP_POLICIES,
    Action,
    Kind,
    Schedule,
    apply_two_bp,
    generate,
    merge_backward,
    to_rows,
    validate,
)
from twobp.schedule._timing import make_timing
from twobp.schedule.walk import walk


def makespan(schedule: Schedule, costs=None) -> float:
    timing = make_timing(costs, schedule)
    walked = walk(schedule, timing.duration, transfer=timing.transfer)
    return max(run.end for runs in walked.runs.values() for run in runs)


def peak_held(schedule: Schedule, rank: int) -> int:
    """Most micro-batches of ``rank`` with F done and W (or B) not done."""
    held = peak = 0
    for a in schedule.actions[rank]:
        if a.kind is Kind.FORWARD:
            held += 1
        elif a.kind in (Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD):
            held -= len(a.microbatches)
        peak = max(peak, held)
    return peak


def test_paper_policy_1f1b_p2_m2():
    s = apply_two_bp(generate("1f1b", 2, 2), "paper")
    assert s.name == "1f1b+2bp:paper"
    assert to_rows(s) == [
        ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"],
        ["1F0", "1I0", "1F1", "1I1", "1W0-1"],
    ]


def test_paper_policy_1f1b_p4_m4_last_rank_concatenates_everything():
    # The 2BP paper's Figure 1 (1F1B-1 with 2BP): the last rank runs all its
    # backward-p1 and one concatenated backward-p2 at the end.
    s = apply_two_bp(generate("1f1b", 4, 4), "paper")
    assert to_rows(s) == [
        ["0F0", "0F1", "0F2", "0F3", "0I0", "0W0", "0I1", "0W1", "0I2", "0W2", "0I3", "0W3"],
        ["1F0", "1F1", "1F2", "1I0", "1F3", "1I1", "1W0", "1I2", "1W1", "1I3", "1W2-3"],
        ["2F0", "2F1", "2I0", "2F2", "2I1", "2F3", "2I2", "2W0", "2I3", "2W1-3"],
        ["3F0", "3I0", "3F1", "3I1", "3F2", "3I2", "3F3", "3I3", "3W0-3"],
    ]
    assert makespan(s) == 15
    assert makespan(apply_two_bp(generate("1f1b", 4, 4), "eager")) == 18
    assert makespan(generate("1f1b", 4, 4)) == 21


def test_paper_policy_naive_m1_overlaps_weight_pass_with_upstream():
    s = apply_two_bp(generate("naive", 3, 1), "paper")
    assert to_rows(s) == [["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"], ["2F0", "2I0", "2W0"]]
    assert makespan(s) < makespan(generate("naive", 3, 1))


def test_eager_puts_each_w_after_its_i():
    s = apply_two_bp(generate("1f1b", 2, 2), "eager")
    assert to_rows(s) == [
        ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"],
        ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"],
    ]


@pytest.mark.parametrize("policy", sorted(TWO_BP_POLICIES))
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "naive"])
def test_merge_undoes_every_policy(name, policy):
    s = generate(name, 4, 8)
    split = apply_two_bp(s, policy)
    validate(split)
    assert merge_backward(split) == s


def test_policy_none_keeps_the_schedule():
    s = generate("zb-h1", 3, 6)
    assert apply_two_bp(s, None) is s


def test_already_split_schedule_gets_its_w_placed_again():
    s = generate("zb-h1", 3, 6)
    eager = apply_two_bp(s, "eager")
    assert eager.name == "zb-h1+2bp:eager"
    for acts in eager.actions.values():
        for a, b in itertools.pairwise(acts):
            if a.kind is Kind.BACKWARD_INPUT:
                assert b == Action(a.stage, Kind.BACKWARD_WEIGHT, a.microbatches)


def test_paper_and_fill_never_slower_than_eager_in_unit_time():
    for name in ("gpipe", "1f1b", "zb-h1", "zb-v", "interleaved-1f1b"):
        s = generate(name, 4, 8)
        eager = makespan(apply_two_bp(s, "eager"))
        assert makespan(apply_two_bp(s, "paper")) <= eager
        assert makespan(apply_two_bp(s, "fill")) <= eager


def test_fill_uses_the_cost_model():
    costs = {"F": 1.0, "I": 1.5, "W": 0.7}
    s = generate("naive", 4, 4)
    fill = apply_two_bp(s, "fill", costs=costs)
    assert makespan(fill, costs) < makespan(apply_two_bp(s, "eager"), costs)
    assert makespan(fill, costs) <= makespan(apply_two_bp(s, "paper", costs=costs), costs)


def test_fill_accepts_an_object_with_duration():
    class Costs:
        def duration(self, action: Action) -> float:
            return {"F": 1.0, "I": 1.0, "W": 2.0}.get(action.kind.value, 0.0) * len(
                action.microbatches
            )

    validate(apply_two_bp(generate("1f1b", 3, 6), "fill", costs=Costs()))


def test_fill_memory_limit_bounds_held_microbatches():
    s = generate("gpipe", 2, 6)
    unbounded = apply_two_bp(s, "fill")
    # GPipe: every forward runs before any I, so the F/I order alone needs 6.
    assert peak_held(unbounded, 0) == 6
    with pytest.raises(ValueError, match="use memory_limit >= 6"):
        apply_two_bp(s, "fill", memory_limit=3)
    one = generate("1f1b", 3, 9)
    for limit in (3, 4, 5):
        bounded = apply_two_bp(one, "fill", memory_limit=limit)
        validate(bounded)
        assert max(peak_held(bounded, r) for r in range(3)) <= limit
    assert peak_held(apply_two_bp(one, "paper"), 0) > 3
    # dynamic lists a W only where the limit forces one (its runtime fills waits).
    for limit in (3, 4, 5):
        assert (
            max(peak_held(apply_two_bp(one, "dynamic", memory_limit=limit), r) for r in range(3))
            <= limit
        )


def test_policy_errors():
    s = generate("1f1b", 2, 2)
    with pytest.raises(ValueError, match="valid policies: eager, paper, fill, dynamic"):
        apply_two_bp(s, "late")
    with pytest.raises(
        ValueError, match="memory_limit applies to policies 'fill' and 'dynamic' only"
    ):
        apply_two_bp(s, "paper", memory_limit=4)
    with pytest.raises(ValueError, match="missing"):
        apply_two_bp(s, "fill", costs={"F": 1.0})
    with pytest.raises(ValueError, match="give one time per stage"):
        apply_two_bp(s, "fill", costs={"F": [1.0], "I": 1.0, "W": 1.0})


def test_costs_per_stage():
    # A slow last stage: rank 0 waits for its gradients and fills the waits with
    # W, from the steady state on with "fill", only in the cool-down with "paper".
    costs = {"F": [1.0, 3.0], "I": [1.0, 3.0], "W": [1.0, 1.0]}
    fill = apply_two_bp(generate("1f1b", 2, 4), "fill", costs=costs)
    paper = apply_two_bp(generate("1f1b", 2, 4), "paper", costs=costs)
    assert " ".join(map(str, fill.actions[0])) == "0F0 0F1 0I0 0F2 0W0 0I1 0F3 0W1 0I2 0W2 0I3 0W3"
    assert " ".join(map(str, paper.actions[0])) == "0F0 0F1 0I0 0F2 0I1 0F3 0W0 0W1 0I2 0W2 0I3 0W3"
    assert " ".join(map(str, fill.actions[1])) == "1F0 1I0 1F1 1I1 1F2 1I2 1F3 1I3 1W0-3"


def test_predicted_times_agree_with_the_simulator():
    # The placement policies predict idle slots with the schedule layer's own
    # list scheduler; it must agree with twobp.sim on every makespan.
    sim = pytest.importorskip("twobp.sim")
    for name in ("1f1b", "zb-v", "interleaved-1f1b"):
        s = generate(name, 4, 8)
        costs = sim.CostModel.uniform(
            s.n_stages, f=1.0, i=1.3, w=0.6, send_latency=0.25, send_bytes=1.0, bandwidth=4.0
        )
        for policy in (None, "eager", "paper", "fill"):
            split = apply_two_bp(s, policy, costs=costs)
            assert makespan(split, costs) == pytest.approx(sim.simulate(split, costs).makespan)
        fill = sim.simulate(apply_two_bp(s, "fill", costs=costs), costs).makespan
        assert fill <= sim.simulate(apply_two_bp(s, "eager"), costs).makespan


@pytest.mark.parametrize("costs", [None, {"F": 1.0, "I": 1.0, "W": 1.0}])
@pytest.mark.parametrize("policy", ["eager", "paper", "fill"])
def test_reductions_follow_the_weight_passes_placed_again(policy, costs):
    from twobp.schedule.lowering import add_reductions, without_reductions

    base = generate("chimera", 4, 8)
    # Only stage 1 reduces; after the split it still does, after its new last W.
    got = apply_two_bp(add_reductions(base, [1]), policy, costs=costs)
    want = add_reductions(apply_two_bp(base, policy, costs=costs), [1])
    assert got.actions == want.actions
    assert without_reductions(got).actions == apply_two_bp(base, policy, costs=costs).actions


class _SendsByHand:
    """Unit costs where each action that sends to the next rank (F of all
    but the last stage) or the previous one (I of all but the first) is
    longer by ``overhead``: one stage per rank, as 1F1B places them."""

    def __init__(self, n_stages: int, overhead: float) -> None:
        self._last = n_stages - 1
        self._overhead = overhead

    def duration(self, action: Action) -> float:
        sends = (action.kind is Kind.FORWARD and action.stage < self._last) or (
            action.kind is Kind.BACKWARD_INPUT and action.stage > 0
        )
        return len(action.microbatches) + (self._overhead if sends else 0.0)


@pytest.mark.parametrize(("n_ranks", "n_microbatches"), [(2, 4), (4, 8)])
@pytest.mark.parametrize("policy", ["paper", "fill"])
def test_the_placement_counts_the_time_a_send_holds_its_sender(policy, n_ranks, n_microbatches):
    from twobp.sim import CostModel, simulate

    schedule = generate("1f1b", n_ranks, n_microbatches)
    costs = CostModel.uniform(n_ranks, send_overhead=1.0)
    placed = apply_two_bp(schedule, policy, costs=costs)
    by_hand = apply_two_bp(schedule, policy, costs=_SendsByHand(n_ranks, 1.0))
    unaware = apply_two_bp(schedule, policy, costs=CostModel.uniform(n_ranks))
    assert placed.actions == by_hand.actions != unaware.actions
    assert simulate(placed, costs).makespan <= simulate(unaware, costs).makespan


def test_counting_the_send_overhead_places_w_where_the_step_is_shorter():
    from twobp.sim import CostModel, simulate

    costs = CostModel.uniform(4, send_overhead=1.0)
    schedule = generate("1f1b", 4, 8)
    placed = apply_two_bp(schedule, "fill", costs=costs)
    unaware = apply_two_bp(schedule, "fill", costs=CostModel.uniform(4))
    assert simulate(placed, costs).makespan == 45.0
    assert simulate(unaware, costs).makespan == 46.0


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("1f1b", (False, True)),
        ("1f1b", (True, False)),
        ("zb-h1", (False, True)),
        ("zb-v", (False, True, True, False)),
        ("interleaved-1f1b", (True, False, False, True)),
        ("chimera", (True, False)),
    ],
)
def test_two_bp_per_stage_fuses_the_stages_given_false(name, split):
    from twobp.schedule import prepare
    from twobp.schedule.lowering import split_stages

    every = prepare(name, n_ranks=2, n_microbatches=4, two_bp=True)
    schedule = prepare(name, n_ranks=2, n_microbatches=4, two_bp=split)
    wanted = {s for s in range(schedule.n_stages) if split[schedule.model_stage(s)]}
    assert split_stages(schedule) == split_stages(every) & wanted
    # Each fused stage runs one B per micro-batch where its I was; the split ones keep theirs.
    for rank, acts in schedule.actions.items():
        for stage in schedule.stages_of(rank):
            mine = [a for a in acts if a.stage == stage]
            theirs = [a for a in every.actions[rank] if a.stage == stage]
            if stage in wanted:
                assert mine == theirs, stage
            else:
                kinds = [a.kind for a in mine if a.kind is not Kind.REDUCE]
                assert kinds.count(Kind.FULL_BACKWARD) == len(schedule.microbatches_of(stage))
                assert Kind.BACKWARD_WEIGHT not in kinds and Kind.BACKWARD_INPUT not in kinds
    assert prepare(name, n_ranks=2, n_microbatches=4, two_bp=(True,) * len(split)) == every
    fused = prepare(name, n_ranks=2, n_microbatches=4, two_bp=False)
    assert prepare(name, n_ranks=2, n_microbatches=4, two_bp=(False,) * len(split)) == fused


def test_two_bp_per_stage_needs_one_bool_per_stage():
    from twobp.schedule import ScheduleConfigError, prepare

    with pytest.raises(ScheduleConfigError, match=r"two_bp=\[True\]: 1 entries for 2 stages"):
        prepare("1f1b", n_ranks=2, n_microbatches=4, two_bp=[True])
    with pytest.raises(ScheduleConfigError, match="one True or False per stage"):
        prepare("1f1b", n_ranks=2, n_microbatches=4, two_bp=("yes", False))
