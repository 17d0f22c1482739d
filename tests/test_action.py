import pytest
from hypothesis import given
from hypothesis import strategies as st

from twobp.schedule import Action, Kind, Schedule


@pytest.mark.parametrize("text", ["1F0", "0I3", "2W0-3", "2W0-1+4", "0B12", "3SEND_F2", "1RECV_B0"])
def test_text_round_trips(text):
    assert str(Action.parse(text)) == text


def test_torch_spelling_parses():
    a = Action.parse("2F10")
    assert (a.stage, a.kind, a.microbatch) == (2, Kind.FORWARD, 10)


@given(st.sets(st.integers(0, 40), min_size=1), st.integers(0, 9))
def test_any_weight_group_round_trips(mbs, stage):
    a = Action.make(stage, "W", mbs)
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "1W3-1", "1W1+1", "1F0-2"])
def test_bad_text_is_rejected(bad):
    with pytest.raises(ValueError):
        Action.parse(bad)


def test_only_w_takes_groups():
    with pytest.raises(ValueError, match="only W"):
        Action(0, Kind.FORWARD, (0, 1))


def test_schedule_checks_placement():
    acts = {0: (Action.parse("0F0"),), 1: (Action.parse("0F0"),)}
    with pytest.raises(ValueError, match="not on rank 1"):
        Schedule((0, 1), 1, acts)
