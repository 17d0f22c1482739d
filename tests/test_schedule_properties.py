"""Property tests over every generator and every 2BP policy (p 1..6, m 1..16, v 1..3)."""

import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from twobp.schedule import (
    SCHEDULES,
    TWO_BP_POLICIES,
    Action,
    Kind,
    Schedule,
    add_communication,
    apply_two_bp,
    from_rows,
    generate,
    load_csv,
    merge_backward,
    save_csv,
    to_rows,
    validate,
)

FAST = settings(max_examples=80, deadline=None)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """Any valid (name, p, m, v) combination, generated."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    info = SCHEDULES[name]
    p = draw(st.integers(1, 6))
    if name == "chimera":  # two pipelines: p and m even
        p, m = 2 * draw(st.integers(1, 3)), 2 * draw(st.integers(1, 8))
    elif name == "dualpipe":  # two pipelines: p and m even, m >= 2p
        p = 2 * draw(st.integers(1, 3))
        m = 2 * draw(st.integers(p, 8))
    elif name == "dualpipev":  # m >= 2p
        m = draw(st.integers(2 * p, 16))
    elif name == "interleaved-1f1b":
        m = p * draw(st.integers(1, 16 // p))
    else:
        m = draw(st.integers(1, 16))
    allowed = info.allowed_stages_per_rank or (1, 2, 3)
    v = draw(st.sampled_from(allowed))
    return generate(name, p, m, stages_per_rank=v)


policies = st.sampled_from([None, *sorted(TWO_BP_POLICIES)])


def compute_counts(s: Schedule) -> Counter[tuple[int, str, int]]:
    """How often each (stage, F / backward-input / weight, micro-batch) is done."""
    counts: Counter[tuple[int, str, int]] = Counter()
    for acts in s.actions.values():
        for a in acts:
            for m in a.microbatches:
                if a.kind is Kind.FORWARD:
                    counts[(a.stage, "F", m)] += 1
                if a.kind in (Kind.BACKWARD_INPUT, Kind.FULL_BACKWARD):
                    counts[(a.stage, "I", m)] += 1
                if a.kind in (Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD):
                    counts[(a.stage, "W", m)] += 1
    return counts


@FAST
@given(schedules(), policies)
def test_every_generator_and_policy_is_valid_and_complete(schedule, policy):
    s = apply_two_bp(schedule, policy)
    validate(s)
    expected = {
        (stage, what, m): 1
        for stage in range(s.n_stages)
        for what in ("F", "I", "W")
        for m in s.microbatches_of(stage)
    }
    assert compute_counts(s) == expected
    for rank, acts in s.actions.items():
        assert all(s.rank_of(a.stage) == rank for a in acts)


@FAST
@given(schedules(), policies)
def test_lowered_schedules_stay_valid(schedule, policy):
    lowered = add_communication(apply_two_bp(schedule, policy))
    validate(lowered)
    sends = sum(
        a.kind in (Kind.SEND_F, Kind.SEND_B) for acts in lowered.actions.values() for a in acts
    )
    recvs = sum(
        a.kind in (Kind.RECV_F, Kind.RECV_B) for acts in lowered.actions.values() for a in acts
    )
    crossing = sum(
        schedule.neighbour(b, 1) is not None and schedule.rank_of(b) != schedule.rank_of(b + 1)
        for b in range(schedule.n_stages - 1)
    )
    per_pipeline = schedule.n_microbatches // schedule.n_pipelines
    assert sends == recvs == 2 * crossing * per_pipeline


@FAST
@given(schedules(), policies)
def test_text_rows_and_csv_round_trip(schedule, policy):
    s = add_communication(apply_two_bp(schedule, policy))
    for acts in s.actions.values():
        for a in acts:
            assert Action.parse(str(a)) == a
    assert from_rows(to_rows(s), name=s.name) == s
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{s.name}.csv"
        save_csv(s, path)
        assert load_csv(path) == s


@FAST
@given(schedules())
def test_aligned_rows_round_trip(schedule):
    s = apply_two_bp(schedule, "paper")
    assert from_rows(to_rows(s, aligned=True), name=s.name) == s


@FAST
@given(schedules(), st.sampled_from(sorted(TWO_BP_POLICIES)))
def test_merge_undoes_the_split_of_fused_schedules(schedule, policy):
    if SCHEDULES[schedule.name].natively_split:
        merged = merge_backward(schedule)
        validate(merged)
        assert merge_backward(apply_two_bp(merged, policy)) == merged
    else:
        assert merge_backward(apply_two_bp(schedule, policy)) == schedule


@FAST
@given(schedules())
def test_paper_keeps_the_order_of_f_and_i(schedule):
    s = apply_two_bp(schedule, "paper")
    eager = apply_two_bp(schedule, "eager")
    for rank in s.actions:
        assert [a for a in s.actions[rank] if a.kind is not Kind.BACKWARD_WEIGHT] == [
            a for a in eager.actions[rank] if a.kind is not Kind.BACKWARD_WEIGHT
        ]
        # At most one concatenated W per stage, and only as the rank's last actions.
        groups = [a for a in s.actions[rank] if len(a.microbatches) > 1]
        assert len({a.stage for a in groups}) == len(groups)
        if s.n_pipelines == 1:
            tail = s.actions[rank][len(s.actions[rank]) - len(groups) :]
            assert all(a in tail for a in groups)
        else:  # each pipeline's stage ends with its own
            acts = s.actions[rank]
            for group in groups:
                later = acts[acts.index(group) :]
                assert not any(a.stage == group.stage for a in later[1:])
