"""Generators as data: exact small schedules, registry errors, in-flight peaks."""

import pytest

from twobp.schedule import SCHEDULES, Kind, Schedule, generate, to_rows, validate


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """Most forwards of ``rank`` whose I or B has not run yet, at any point."""
    waiting = peak = 0
    for a in schedule.actions[rank]:
        if a.kind is Kind.FORWARD:
            waiting += 1
        elif a.kind in (Kind.BACKWARD_INPUT, Kind.FULL_BACKWARD):
            waiting -= 1
        peak = max(peak, waiting)
    return peak


def test_gpipe_p2_m2():
    assert to_rows(generate("gpipe", 2, 2)) == [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1F1", "1B0", "1B1"],
    ]


def test_gpipe_p2_m4():
    assert to_rows(generate("gpipe", 2, 4)) == [
        ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"],
        ["1F0", "1F1", "1F2", "1F3", "1B0", "1B1", "1B2", "1B3"],
    ]


def test_1f1b_p2_m2():
    assert to_rows(generate("1f1b", 2, 2)) == [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1B0", "1F1", "1B1"],
    ]


def test_1f1b_p2_m4():
    assert to_rows(generate("1f1b", 2, 4)) == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"],
    ]


def test_1f1b_with_fewer_microbatches_than_ranks_is_gpipe_like():
    assert to_rows(generate("1f1b", 4, 2)) == [
        ["0F0", "0F1", "0B0", "0B1"],
        ["1F0", "1F1", "1B0", "1B1"],
        ["2F0", "2F1", "2B0", "2B1"],
        ["3F0", "3B0", "3F1", "3B1"],
    ]


def test_naive_runs_one_microbatch_at_a_time():
    assert to_rows(generate("naive", 2, 2)) == [
        ["0F0", "0B0", "0F1", "0B1"],
        ["1F0", "1B0", "1F1", "1B1"],
    ]


def test_zb_h1_p2():
    assert to_rows(generate("zb-h1", 2, 2)) == [
        ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"],
    ]
    assert to_rows(generate("zb-h1", 2, 4)) == [
        ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0F3", "0I2", "0W2", "0I3", "0W3"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"],
    ]


def test_interleaved_p2_m2_v2_uses_looped_placement():
    s = generate("interleaved-1f1b", 2, 2, stages_per_rank=2)
    assert s.placement == (0, 1, 0, 1)
    assert to_rows(s) == [
        ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
        ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"],
    ]


def test_zb_v_placement_is_a_v():
    s = generate("zb-v", 3, 6)
    assert s.placement == (0, 1, 2, 2, 1, 0)
    assert s.stages_of(0) == (0, 5)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_registered_schedule_is_valid_and_reports_its_split(name):
    s = generate(name, 4, 8)
    validate(s)
    kinds = {a.kind for acts in s.actions.values() for a in acts}
    if SCHEDULES[name].natively_split:
        split = {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
        # DualPipe(V) runs the backwards of its steady state fused, as published.
        fused = {Kind.FULL_BACKWARD} if name.startswith("dualpipe") else set()
        assert kinds == split | fused
    else:
        assert kinds == {Kind.FORWARD, Kind.FULL_BACKWARD}
    assert s.name == name
    assert SCHEDULES[name].description


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'") as info:
        generate("pipedream", 2, 2)
    for name in SCHEDULES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "message"),
    [
        ("interleaved-1f1b", 4, 6, 2, "multiple of the number of ranks"),
        ("zb-v", 2, 4, 3, "zb-v takes stages_per_rank 2"),
        ("1f1b", 2, 4, 2, "1f1b takes stages_per_rank 1"),
        ("zb-h1", 2, 4, 2, "naive, gpipe, interleaved-1f1b"),
        ("gpipe", 0, 4, 1, "n_ranks >= 1"),
        ("gpipe", 2, 0, 1, "n_microbatches >= 1"),
        ("gpipe", 2, 2, 0, "any v >= 1"),
    ],
)
def test_impossible_combinations_raise(name, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        generate(name, p, m, stages_per_rank=v)


def test_default_stages_per_rank():
    assert generate("interleaved-1f1b", 2, 4).n_stages == 4
    assert generate("zb-v", 2, 4).n_stages == 4
    assert generate("gpipe", 2, 4).n_stages == 2
    assert generate("gpipe", 2, 4, stages_per_rank=3).placement == (0, 1, 0, 1, 0, 1)


def test_zb_h1_keeps_1f1b_in_flight_peak_and_zb_h2_exceeds_it():
    p, m = 4, 8
    one_f_one_b, h1, h2 = (generate(n, p, m) for n in ("1f1b", "zb-h1", "zb-h2"))
    for rank in range(p):
        assert peak_in_flight(one_f_one_b, rank) == p - rank
        assert peak_in_flight(h1, rank) == p - rank
        assert peak_in_flight(h2, rank) == 2 * (p - 1 - rank) + 1
    assert peak_in_flight(h2, 0) == 2 * p - 1 > peak_in_flight(h1, 0)


def test_zb_v_holds_as_much_as_1f1b_rank_0():
    # A ZB-V stage is half of a 1F1B stage: 2p half-stage activations on every
    # rank are the p full-stage activations of 1F1B's first rank.
    p = 4
    s = generate("zb-v", p, 16)
    assert [peak_in_flight(s, r) for r in range(p)] == [2 * p] * p
    assert peak_in_flight(generate("1f1b", p, 16), 0) == p
