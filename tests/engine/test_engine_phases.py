"""The per-micro-batch state machine, tested as pure data (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twobp.engine.phases import MicrobatchPhases, Phase, TwoStageBackwardError


def test_forward_input_weight():
    phases = MicrobatchPhases()
    phases.start_forward(0)
    phases.start_forward(1)
    phases.check_input(1)
    phases.finish_input(1)
    assert phases.phase(0) is Phase.FORWARD
    assert phases.pending_weight() == (1,)
    assert phases.check_weight([1]) == (1,)
    phases.finish_weight(1)
    assert phases.pending_weight() == ()
    assert phases.known() == (0, 1)


def test_input_of_a_plain_forward_is_accepted():
    phases = MicrobatchPhases()
    phases.check_input(5)
    phases.finish_input(5)
    assert phases.pending_weight() == (5,)


def _at(phase: str, mb: int = 3) -> MicrobatchPhases:
    phases = MicrobatchPhases(label="rank 1 stage 2")
    if phase in ("F", "I", "W"):
        phases.start_forward(mb)
    if phase in ("I", "W"):
        phases.check_input(mb)
        phases.finish_input(mb)
    if phase == "W":
        phases.check_weight([mb])
        phases.finish_weight(mb)
    return phases


@pytest.mark.parametrize(
    ("phase", "action", "words"),
    [
        ("F", "F", "already"),
        ("I", "F", "already"),
        ("I", "I", "twice"),
        ("W", "I", "already ran"),
        ("F", "W", "before its backward_input"),
        ("W", "W", "twice"),
        ("none", "W", "no forward"),
    ],
)
def test_wrong_order_says_what_happened(phase, action, words):
    phases = _at(phase)
    run = {
        "F": lambda: phases.start_forward(3),
        "I": lambda: phases.check_input(3),
        "W": lambda: phases.check_weight([3]),
    }[action]
    with pytest.raises(TwoStageBackwardError, match=words) as info:
        run()
    assert "rank 1 stage 2" in str(info.value)
    assert "micro-batch 3" in str(info.value)


def test_weight_group_is_refused_as_a_whole():
    phases = _at("I", 0)
    phases.start_forward(1)
    with pytest.raises(TwoStageBackwardError, match="W1"):
        phases.check_weight([0, 1])
    assert phases.pending_weight() == (0,)


def test_weight_group_must_be_non_empty_and_distinct():
    phases = _at("I", 0)
    with pytest.raises(ValueError, match="at least one"):
        phases.check_weight([])
    with pytest.raises(ValueError, match=r"\[0\]"):
        phases.check_weight([0, 0])


@pytest.mark.parametrize(("phase", "words"), [("F", "no backward_input"), ("I", "no backward_w")])
def test_end_step_with_pending_work_raises_and_clears(phase, words):
    phases = _at(phase)
    with pytest.raises(TwoStageBackwardError, match=words):
        phases.end_step()
    assert phases.known() == ()
    phases.start_forward(3)  # ids are reusable after the failed end


def test_cancel_forward_forgets_only_a_forward():
    phases = _at("F", 0)
    phases.cancel_forward(0)
    assert phases.known() == ()
    phases = _at("I", 0)
    phases.cancel_forward(0)
    assert phases.phase(0) is Phase.INPUT


@given(st.permutations(range(6)), st.lists(st.integers(1, 6), min_size=1, max_size=6), st.data())
def test_any_valid_order_and_grouping_passes(input_order, group_sizes, data):
    """Forwards, then I in any order, W in any groups once their I ran: no error."""
    phases = MicrobatchPhases()
    for mb in range(6):
        phases.start_forward(mb)
    done_input: list[int] = []
    pending = list(input_order)
    sizes = iter(group_sizes * 6)
    while pending or phases.pending_weight():
        if pending and (not phases.pending_weight() or data.draw(st.booleans())):
            mb = pending.pop(0)
            phases.check_input(mb)
            phases.finish_input(mb)
            done_input.append(mb)
            continue
        ready = list(phases.pending_weight())
        group = data.draw(st.permutations(ready))[: next(sizes)]
        for mb in phases.check_weight(group):
            phases.finish_weight(mb)
    phases.end_step()
    assert sorted(done_input) == list(range(6))
