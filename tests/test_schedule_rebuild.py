"""The pass that marks rebuilt stashes in a schedule (IR and WR), as data."""

from __future__ import annotations

import pytest

from twobp.schedule import Action, Kind, Schedule, ScheduleError, validate
from twobp.schedule.lowering import add_reductions, merge_backward
from twobp.schedule.prepare import prepare
from twobp.schedule.rebuild import mark_rebuilds, rebuilt_microbatches


def _one_f1b() -> Schedule:
    return prepare("1f1b", n_ranks=2, n_microbatches=4)


def test_marks_the_chosen_input_and_weight_passes():
    schedule = _one_f1b()
    assert schedule.actions[1] == tuple(
        map(Action.parse, ["1F0", "1I0", "1F1", "1I1", "1F2", "1I2", "1F3", "1I3", "1W0-3"])
    )
    marked = mark_rebuilds(schedule, {1: [0, 2]})
    # The kept stashes are given back first, then each rebuilt one is held alone.
    assert " ".join(map(str, marked.actions[1])) == (
        "1F0 1IR0 1F1 1I1 1F2 1IR2 1F3 1I3 1W1+3 1WR0 1WR2"
    )
    assert marked.actions[0] == schedule.actions[0]
    validate(marked)
    assert rebuilt_microbatches(marked) == {1: (0, 2)}
    assert rebuilt_microbatches(schedule) == {}
    assert mark_rebuilds(schedule, {}) is schedule


def test_a_rebuild_may_run_last_and_reductions_follow_it():
    schedule = add_reductions(_one_f1b())
    marked = mark_rebuilds(schedule, {0: [0]}, last=[(0, 0)])
    text = " ".join(map(str, marked.actions[0]))
    assert "0IR0" in text and text.endswith("0WR0 0R0-3"), text
    validate(marked)
    # Marking more keeps what was marked, where it was placed.
    again = mark_rebuilds(marked, {0: [0, 2]})
    assert rebuilt_microbatches(again) == {0: (0, 2)}
    assert " ".join(map(str, again.actions[0])).endswith("0WR0 0R0-3")


def test_the_text_form_parses_back():
    for text in ("1IR3", "0WR2", "2WR0-1"):
        assert str(Action.parse(text)) == text
    assert Action.parse("1IR3").kind is Kind.BACKWARD_INPUT_REBUILT
    assert Action.parse("0WR2").kind is Kind.BACKWARD_WEIGHT_REBUILD


def test_a_fused_backward_has_nothing_to_rebuild():
    with pytest.raises(ValueError, match=r"stage 0 micro-batch 1: no I there"):
        mark_rebuilds(prepare("1f1b", n_ranks=2, n_microbatches=4, two_bp=False), {0: [1]})


def test_validation_wants_both_halves_of_a_rebuild():
    schedule = _one_f1b()
    rows = {r: list(acts) for r, acts in schedule.actions.items()}
    rows[1][1] = Action.parse("1IR0")  # its W is a plain W: nothing would rebuild it
    with pytest.raises(ScheduleError, match=r"stage 1 micro-batch 0: an IR needs a WR"):
        validate(schedule.with_actions(rows))


def test_merging_back_drops_the_marks():
    marked = mark_rebuilds(_one_f1b(), {1: [1]})
    fused = merge_backward(marked)
    assert all(
        a.kind in (Kind.FORWARD, Kind.FULL_BACKWARD)
        for acts in fused.actions.values()
        for a in acts
    )
