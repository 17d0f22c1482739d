"""The walker: start times by the dependency rules, steps, transfers, slowdown, fill, deadlocks."""

import pytest

from twobp.schedule import (
    SCHEDULES,
    Action,
    DeadlockError,
    Schedule,
    ScheduleError,
    add_communication,
    apply_two_bp,
    dry_run,
    generate,
    walk,
)

UNIT = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


def make(rows: list[str], n_microbatches: int, name: str = "hand") -> Schedule:
    actions = {r: tuple(Action.parse(t) for t in row.split()) for r, row in enumerate(rows)}
    return Schedule(tuple(range(len(rows))), n_microbatches, actions, name)


def unit(action: Action) -> float:
    return UNIT.get(action.kind.value, 0.0) * len(action.microbatches)


def times(walked) -> dict[str, tuple[float, float]]:
    return {str(r.action): (r.start, r.end) for runs in walked.runs.values() for r in runs}


def test_an_action_starts_when_its_rank_is_free_and_its_inputs_have_arrived():
    s = make(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], 2)
    walked = walk(s, unit, transfer=lambda boundary: 0.5)
    assert times(walked) == {
        "0F0": (0.0, 1.0),
        "0F1": (1.0, 2.0),
        "1F0": (1.5, 2.5),  # 0F0 ends at 1, crosses to rank 1 in 0.5
        "1B0": (2.5, 4.5),
        "1F1": (4.5, 5.5),
        "1B1": (5.5, 7.5),
        "0B0": (5.0, 7.0),  # 1B0 ends at 4.5, back in 0.5
        "0B1": (8.0, 10.0),
    }
    assert [r.action for r in walked.runs[1]] == list(s.actions[1])


def test_steps_are_the_dry_run_grid_and_the_start_times_of_unit_actions():
    for name in SCHEDULES:
        p = 4 if name in ("chimera", "dualpipe") else 3  # two pipelines: p even
        m = 8 if name == "dualpipe" else 6  # dualpipe(v): m >= 2p
        s = apply_two_bp(generate(name, p, m), "paper")
        walked = walk(s, lambda a: 1.0)
        assert walked.grid() == dry_run(s), name
        assert all(r.start == r.step for runs in walked.runs.values() for r in runs), name


def test_transfer_actions_are_walked_only_when_lowered():
    s = add_communication(generate("1f1b", 2, 2))
    skipped = walk(s, unit)
    assert all(r.action.kind.is_compute for runs in skipped.runs.values() for r in runs)
    assert times(skipped) == times(walk(generate("1f1b", 2, 2), unit))
    lowered = walk(s, unit, lowered=True)
    assert [str(r.action) for r in lowered.runs[1]][:3] == ["1RECV_F0", "1F0", "1B0"]
    assert times(lowered)["1RECV_F0"] == (1.0, 1.0)


def test_a_slowdown_shares_the_rate_between_ranks_that_compute_at_once():
    # From 1, rank 0 runs 0F1 (work 3) and rank 1 runs 1F0 (work 1) at once,
    # each at half speed: 1F0 ends at 3, and 0F1, alone again, at 5.
    s = make(["0F0 0F1", "1F0"], 2)
    work = {"0F0": 1.0, "0F1": 3.0, "1F0": 1.0}
    shared = walk(s, lambda a: work[str(a)], slowdown=lambda k: float(k))
    assert times(shared) == {"0F0": (0.0, 1.0), "0F1": (1.0, 5.0), "1F0": (1.0, 3.0)}
    fixed = walk(s, lambda a: work[str(a)])
    assert times(fixed) == {"0F0": (0.0, 1.0), "0F1": (1.0, 4.0), "1F0": (1.0, 2.0)}


def test_a_fill_runs_extra_work_where_the_rank_would_wait():
    s = make(["0F0 0I0", "1F0 1I0"], 1)
    extra = Action.parse("0W0")

    def fill(walker, rank):
        ran = [r.action for r in walker.runs(rank)]
        gap = walker.earliest_start(rank) - walker.free_at(rank)
        if rank == 0 and ran == [Action.parse("0F0")] and gap >= unit(extra):
            return extra
        return None

    walked = walk(s, unit, fill=fill)
    assert [str(r.action) for r in walked.runs[0]] == ["0F0", "0W0", "0I0"]
    assert times(walked)["0W0"] == (1.0, 2.0)
    assert times(walked)["0I0"] == (3.0, 4.0)  # not delayed: 1I0 ends at 3
    with pytest.raises(ValueError, match="fixed durations only"):
        walk(s, unit, fill=fill, slowdown=lambda k: 1.0)


def test_deadlock_is_a_schedule_error_with_the_stuck_ranks_and_the_grid():
    s = make(["0F0 0B0", "1B0 1F0"], 1)
    with pytest.raises(DeadlockError) as info:
        walk(s, unit, transfer=lambda b: 0.25)
    assert isinstance(info.value, ScheduleError) and isinstance(info.value, RuntimeError)
    text = str(info.value)
    assert text.startswith("hand deadlocks at step 1: no rank can run its next action.")
    assert "rank 1 is stuck at 1B0 (its action #0): waits for 1F0 (rank 1, its action #1" in text
    assert text.splitlines()[-1].split() == ["stuck", "|", ">0B0<", "|", ">1B0<"]


def test_the_same_work_listed_twice_is_refused_before_walking():
    with pytest.raises(ScheduleError, match="repeats work already listed at rank 0 step 0"):
        walk(make(["0F0 0F0"], 1), unit)
