"""The kind table: built-in entries, and a kind declared only in the table."""

import dataclasses

import pytest

from twobp.schedule import (
    KINDS,
    Action,
    DeadlockError,
    Kind,
    KindSpec,
    MemoryChange,
    Moment,
    Need,
    Role,
    Schedule,
    ScheduleError,
    declare_kind,
    dry_run,
    register_kind,
    validate,
)
from twobp.schedule.dependencies import produces, requires
from twobp.schedule.kinds import ACTIVATIONS, STORED_DERIVATIVES, held_change, pool_change
from twobp.schedule.schedule import StageGraph
from twobp.sim.costs import CostModel
from twobp.sim.memory import memory_timeline
from twobp.sim.simulate import simulate
from twobp.timeline import kind_label
from twobp.viz.ascii import render_ascii
from twobp.viz.png import legend_kinds, render_png

# A recomputation of a stage's forward output: after its own F, and after
# that of the stage before it (on another rank: a transfer away). It holds
# the activations it recomputes while it runs.
RECOMPUTE = KindSpec(
    "X",
    "recompute",
    needs=(Need("F"), Need("X", -1)),
    makes=("X",),
    cost="forward",
    memory=(MemoryChange(ACTIVATIONS, +1, Moment.START), MemoryChange(ACTIVATIONS, -1)),
)


@pytest.fixture
def recompute():
    return declare_kind(RECOMPUTE)


def make(
    rows: list[str], n_microbatches: int = 1, name: str = "hand", kinds: tuple = ()
) -> Schedule:
    actions = {r: tuple(Action.parse(t, kinds) for t in row.split()) for r, row in enumerate(rows)}
    return Schedule(tuple(range(len(rows))), n_microbatches, actions, name)


def test_every_built_in_kind_has_one_entry():
    assert list(KINDS) == [
        "F",
        "I",
        "W",
        "B",
        "IR",
        "WR",
        "R",
        "SEND_F",
        "RECV_F",
        "SEND_B",
        "RECV_B",
    ]
    assert {Kind(code) for code in KINDS} == set(Kind)
    cost_fields = {f.name for f in dataclasses.fields(CostModel)}
    made = {tag for spec in KINDS.values() for tag in spec.makes}
    for code, spec in KINDS.items():
        assert spec.code == code
        assert spec.is_compute == (spec.cost is not None) == (spec.link is None), code
        assert spec.background == (code == "R") == (spec.role is Role.BACKGROUND), code
        assert (spec.role is Role.SEND) == code.startswith("SEND_"), code
        assert (spec.role is Role.RECEIVE) == code.startswith("RECV_"), code
        assert spec.cost is None or spec.cost in cost_fields, code
        assert all(need.tag in made for need in spec.needs), code
        assert all(need.via is None or need.via in KINDS for need in spec.needs), code


def test_memory_read_from_the_table():
    # A micro-batch is held from its F through its I (activations become
    # stored derivatives) to its W, or from its F to its fused B.
    held = {code: held_change(code) for code in KINDS}
    assert held == {"F": 1, "I": 0, "W": -1, "B": -1, "IR": 0, "WR": -1, "R": 0} | dict.fromkeys(
        ["SEND_F", "RECV_F", "SEND_B", "RECV_B"], 0
    )
    assert [pool_change(k, ACTIVATIONS) for k in "FIWB"] == [1, -1, 0, -1]
    assert [pool_change(k, STORED_DERIVATIVES) for k in "FIWB"] == [0, 1, -1, 0]
    assert Action.parse("2W0-3").held_change() == -4
    assert Action.parse("1I0").held_change(ACTIVATIONS) == -1


def test_rules_read_from_the_table():
    graph = StageGraph((0, 1, 1), n_pipelines=1)
    assert requires(Action.parse("0F0"), graph, lowered=False) == ()
    assert requires(Action.parse("1F0"), graph, lowered=False) == ((0, "F", 0),)
    assert requires(Action.parse("1F0"), graph, lowered=True) == ((1, "RECV_F", 0),)
    assert requires(Action.parse("2F0"), graph, lowered=True) == ((1, "F", 0),)
    assert requires(Action.parse("1I0"), graph, lowered=True) == ((1, "F", 0), (2, "BI", 0))
    assert requires(Action.parse("0B0"), graph, lowered=True) == ((0, "F", 0), (0, "RECV_B", 0))
    assert requires(Action.parse("1W0-1"), graph, lowered=False) == ((1, "BI", 0), (1, "BI", 1))
    assert produces(Action.parse("2B3")) == ((2, "BI", 3), (2, "W", 3))


def test_a_kind_declared_only_in_the_table_is_validated_simulated_and_drawn(recompute, tmp_path):
    assert Action.parse("1X0", [recompute]).kind is recompute and recompute.is_compute
    assert str(Action.parse("1X0", [recompute])) == "1X0" and kind_label(recompute) == "recompute"
    s = make(["0F0 0X0 0B0", "1F0 1X0 1B0"], kinds=(recompute,))

    validate(s)
    assert [[str(a) if a else "." for a in row] for row in dry_run(s)] == [
        ["0F0", "."],
        ["0X0", "1F0"],
        [".", "1X0"],
        [".", "1B0"],
        ["0B0", "."],
    ]
    with pytest.raises(ScheduleError, match=r"rank 1 lists 1X0 \(its action #0\) before 1F0"):
        validate(make(["0F0 0X0 0B0", "1X0 1F0 1B0"], kinds=(recompute,)))

    # R costs a forward (1); a transfer takes 0.5, also for 0X0 -> 1X0.
    costs = CostModel.uniform(2, send_latency=0.5)
    result = simulate(s, costs)
    assert [(str(x.action), x.start, x.end) for x in result.spans] == [
        ("0F0", 0.0, 1.0),
        ("0X0", 1.0, 2.0),
        ("0B0", 6.0, 8.0),
        ("1F0", 1.5, 2.5),
        ("1X0", 2.5, 3.5),
        ("1B0", 3.5, 5.5),
    ]
    # X holds a second copy of the activations while it runs: its memory is
    # simulated from its entry alone (1 unit each for F and X, parameters 0).
    assert result.peak_memory == (2.0, 2.0)
    assert memory_timeline(result.spans, costs, s.placement)[0] == [
        (0.0, 0.0),
        (0.0, 1.0),  # 0F0 starts
        (1.0, 2.0),  # 0X0 starts
        (2.0, 1.0),  # 0X0 ends
        (8.0, 0.0),  # 0B0 ends
    ]
    shared = simulate(s, dataclasses.replace(costs, contention=1.5))
    assert {str(x.action) for x in shared.spans} == {"0F0", "0X0", "0B0", "1F0", "1X0", "1B0"}
    assert shared.makespan > result.makespan

    grid = render_ascii(result.spans, title="recompute")
    assert grid.splitlines()[1].split("|")[1].split() == ["F0", "X0", ".", ".", ".", ".", "B0~~~"]
    assert render_png(result.spans, tmp_path / "r.png").stat().st_size > 0
    assert legend_kinds(result.spans) == [Kind.FORWARD, Kind.FULL_BACKWARD, recompute]


def test_a_declared_kind_takes_part_in_deadlocks(recompute):
    # 1X0 needs 0X0, listed after 0B0, which needs 1B0, listed after 1X0.
    s = make(["0F0 0B0 0X0", "1F0 1X0 1B0"], kinds=(recompute,))
    with pytest.raises(DeadlockError, match=r"rank 1 is stuck at 1X0 .* waits for 0X0 \(rank 0"):
        dry_run(s)
    with pytest.raises(DeadlockError, match=r"waits for 0X0 \(rank 0, its action #2"):
        simulate(s, CostModel.uniform(2))


def test_declaring_checks_the_entry_and_changes_nothing_shared():
    with pytest.raises(ValueError, match="exists already"):
        declare_kind(dataclasses.replace(RECOMPUTE, code="F"))
    with pytest.raises(ValueError, match="upper-case"):
        declare_kind(dataclasses.replace(RECOMPUTE, code="r"))
    with pytest.raises(ValueError, match="cost of kind X"):
        declare_kind(dataclasses.replace(RECOMPUTE, cost="recompute"))
    with pytest.raises(ValueError, match="role compute and link 1"):
        declare_kind(dataclasses.replace(RECOMPUTE, link=+1))
    with pytest.raises(ValueError, match="role send and link None"):
        declare_kind(dataclasses.replace(RECOMPUTE, role=Role.SEND))
    with pytest.raises(ValueError, match="transfers between ranks are the built-in SEND_F"):
        declare_kind(dataclasses.replace(RECOMPUTE, role=Role.SEND, link=+1))
    with pytest.raises(ValueError, match="pool must be one of"):
        declare_kind(dataclasses.replace(RECOMPUTE, memory=(MemoryChange("act", +1),)))
    with pytest.raises(ValueError, match="change must be"):
        declare_kind(dataclasses.replace(RECOMPUTE, memory=(MemoryChange(ACTIVATIONS, 2),)))
    with pytest.raises(ValueError, match="cap must be"):
        declare_kind(
            dataclasses.replace(RECOMPUTE, memory=(MemoryChange(ACTIVATIONS, 1, cap="forward"),))
        )
    kind = declare_kind(RECOMPUTE)
    assert kind == declare_kind(RECOMPUTE)
    # Only the text that is passed the kind knows it: the built-in table and Kind do not.
    assert "X" not in KINDS
    with pytest.raises(ValueError, match="kinds are F, I, W"):
        Action.parse("0X0")
    with pytest.raises(ValueError):
        Kind("X")
    other = declare_kind(dataclasses.replace(RECOMPUTE, label="another"))
    with pytest.raises(ValueError, match="two declared kinds have the code 'X'"):
        Action.parse("0X0", [kind, other])


def test_register_kind_declares_without_adding_to_kind():
    with pytest.warns(DeprecationWarning, match="declare_kind"):
        kind = register_kind(RECOMPUTE)
    assert kind == declare_kind(RECOMPUTE)
    assert "X" not in KINDS
