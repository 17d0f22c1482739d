"""Validation: coverage, order on a rank, deadlocks with the rank-by-step grid."""

import pytest

from twobp.schedule import (
    Action,
    Schedule,
    ScheduleError,
    add_communication,
    apply_two_bp,
    dry_run,
    generate,
    validate,
)


def make(rows: list[str], n_microbatches: int, placement=None, name="hand-made") -> Schedule:
    actions = {r: tuple(Action.parse(t) for t in row.split()) for r, row in enumerate(rows)}
    placement = placement or tuple(range(len(rows)))
    return Schedule(placement, n_microbatches, actions, name)


def test_valid_hand_made_schedule_passes():
    validate(make(["0F0 0F1 0I0 0I1 0W0-1", "1F0 1I0 1F1 1I1 1W1 1W0"], 2))


def test_deadlock_shows_grid_and_marks_stuck_steps():
    s = make(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], 2)
    with pytest.raises(ScheduleError) as info:
        validate(s)
    text = str(info.value)
    assert "hand-made deadlocks at step 1" in text
    assert "rank 0 is stuck at 0B0 (its action #1): waits for 1I0 or 1B0 or 1IR0 (rank 1" in text
    assert "rank 1 is stuck at 1F1 (its action #0): waits for 0F1 (rank 0" in text
    assert ">0B0<" in text and ">1F1<" in text
    grid = text[text.index("step |") :].splitlines()
    assert grid[0].split("|")[1:] == [" rank 0 ", " rank 1"]
    assert grid[2].split() == ["0", "|", "0F0", "|", "."]
    assert grid[3].split() == ["stuck", "|", ">0B0<", "|", ">1F1<"]


def test_deadlock_names_finished_ranks_and_missing_producers():
    # Rank 0 finishes; rank 1 waits for a forward that rank 0 never lists.
    s = make(["0F0 0B0", "1F0 1B0 1F1 1B1"], 2)
    with pytest.raises(ScheduleError, match="stage 0 micro-batch 1: expected one 0F1"):
        validate(s)
    with pytest.raises(ScheduleError) as info:
        dry_run(s)
    assert "waits for 0F1, which no rank lists" in str(info.value)
    assert "(done)" in str(info.value)


def test_missing_and_repeated_actions_are_named():
    with pytest.raises(ScheduleError, match="expected one 0F0 on rank 0, found 2"):
        validate(make(["0F0 0F0 0B0", "1F0 1B0"], 1))
    with pytest.raises(ScheduleError, match="expected one 1I0 and one W covering micro-batch 0"):
        validate(make(["0F0 0B0", "1F0 1I0"], 1))
    with pytest.raises(ScheduleError, match="both 1B0 and a split backward"):
        validate(make(["0F0 0B0", "1F0 1I0 1B0 1W0"], 1))
    with pytest.raises(ScheduleError, match="has no backward: add 1B0"):
        validate(make(["0F0 0B0", "1F0"], 1))
    with pytest.raises(ScheduleError, match="found 1 I and 2 W"):
        validate(make(["0F0 0F1 0I0 0I1 0W0-1 0W1", "1F0 1B0 1F1 1B1"], 2))


def test_wrong_order_on_a_rank_says_what_to_move():
    with pytest.raises(ScheduleError, match=r"rank 1 lists 1W0 \(its action #1\) before 1I0"):
        validate(make(["0F0 0I0 0W0", "1F0 1W0 1I0"], 1))
    with pytest.raises(ScheduleError, match=r"rank 0 lists 0B0 .* before 0F0"):
        validate(make(["0B0 0F0"], 1))


def test_lowered_schedule_validates_and_missing_transfers_are_reported():
    s = add_communication(generate("1f1b", 2, 2))
    validate(s)
    assert [str(a) for a in s.actions[1]][:3] == ["1RECV_F0", "1F0", "1B0"]
    broken = s.with_actions({0: s.actions[0], 1: [a for a in s.actions[1] if str(a) != "1RECV_F1"]})
    with pytest.raises(ScheduleError, match="rank 1 lacks 1RECV_F1"):
        validate(broken)
    late = list(s.actions[1])
    late.remove(Action.parse("1RECV_F0"))
    late.append(Action.parse("1RECV_F0"))
    with pytest.raises(ScheduleError, match=r"rank 1 lists 1F0 .* before 1RECV_F0"):
        validate(s.with_actions({0: s.actions[0], 1: late}))


def test_transfer_between_stages_of_one_rank_is_rejected():
    s = generate("zb-v", 2, 2)  # stages 1 and 2 are both on rank 1
    lowered = add_communication(s)
    assert not any("RECV_F" in str(a) and a.stage == 2 for a in lowered.actions[1])
    extra = [*lowered.actions[1], Action.parse("1SEND_F0")]
    with pytest.raises(ScheduleError, match="1SEND_F0 on rank 1 is not a transfer between two"):
        validate(lowered.with_actions({0: lowered.actions[0], 1: extra}))


def test_dry_run_grid_of_gpipe():
    steps = dry_run(generate("gpipe", 2, 2))
    assert [[str(a) if a else "." for a in row] for row in steps] == [
        ["0F0", "."],
        ["0F1", "1F0"],
        [".", "1F1"],
        [".", "1B0"],
        ["0B0", "1B1"],
        ["0B1", "."],
    ]


def test_long_deadlock_grid_is_truncated():
    s = generate("1f1b", 2, 40)
    rank0 = list(s.actions[0])
    assert [str(a) for a in rank0[-3:]] == ["0F39", "0B38", "0B39"]
    rank0[-3:] = rank0[-2:] + rank0[-3:-2]  # 0B39 now waits for 1B39, which waits for 0F39
    with pytest.raises(ScheduleError, match="earlier steps not shown") as info:
        dry_run(s.with_actions({0: rank0, 1: s.actions[1]}))
    assert "rank 0 is stuck at 0B39" in str(info.value)
    assert "rank 1 is stuck at 1F39" in str(info.value)


def test_apply_two_bp_rejects_lowered_schedules():
    with pytest.raises(ValueError, match="before add_communication"):
        apply_two_bp(add_communication(generate("1f1b", 2, 2)))
