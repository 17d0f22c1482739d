"""Chimera as data: two pipelines in opposite directions, and the reduction action R."""

from __future__ import annotations

import pytest

from twobp.schedule import ScheduleError, generate, validate
from twobp.schedule.action import Action, Kind
from twobp.schedule.chimera import chimera, chimera_placement
from twobp.schedule.csv_io import from_rows, to_rows
from twobp.schedule.lowering import add_communication, add_reductions, without_reductions
from twobp.schedule.prepare import prepare
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import plan_communication
from twobp.sim import simulate
from twobp.sim.costs import CostModel


def test_each_rank_holds_a_stage_of_both_pipelines():
    s = chimera(4, 8)
    assert s.placement == chimera_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.n_pipelines == 2 and s.pipeline_stages == 4
    assert [s.model_stage(x) for x in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert s.replicas_of(1) == (1, 5)
    assert s.microbatches_of(0) == range(0, 4) and s.microbatches_of(7) == range(4, 8)
    # Stage 3 ends the down pipeline; it has no next stage, and stage 4 no previous one.
    assert s.neighbour(3, +1) is None and s.neighbour(4, -1) is None
    assert s.neighbour(4, +1) == 5
    validate(s)


def test_the_docstring_example():
    s = chimera(2, 4)
    assert [" ".join(map(str, s.actions[r])) for r in (0, 1)] == [
        "0F0 0F1 3F2 3B2 0B0 0B1 3F3 3B3",
        "2F2 1F0 1B0 1F1 1B1 2F3 2B2 2B3",
    ]


@pytest.mark.parametrize(
    ("p", "m", "message"),
    [(3, 4, "even number of ranks.*got 3"), (4, 5, "even number of micro-batches.*got 5")],
)
def test_odd_ranks_or_microbatches_are_refused(p, m, message):
    with pytest.raises(ValueError, match=message):
        generate("chimera", p, m)


def test_a_stage_runs_only_its_pipelines_microbatches():
    with pytest.raises(ValueError, match=r"stage 2 is in pipeline 1, which runs micro-batches 1"):
        Schedule(
            (0, 1, 1, 0),
            2,
            {0: (Action(0, Kind.FORWARD, (0,)),), 1: (Action(2, Kind.FORWARD, (0,)),)},
            n_pipelines=2,
        )


def test_shortens_the_bubble_of_1f1b_at_unit_costs():
    # F = 1 and B = 2: each rank of either schedule computes 8 x 3 = 24. 1F1B idles
    # (p - 1)(F + B) = 9 of its (m + p - 1)(F + B) = 33; Chimera's two pipelines of
    # 4 micro-batches fill part of that: 7, not half of it.
    costs = CostModel.uniform(4)
    one = simulate(generate("1f1b", 4, 8), costs)
    s = generate("chimera", 4, 8)
    two = simulate(s, costs.for_schedule(s.n_stages, s.n_pipelines))
    assert one.busy == two.busy == (24.0,) * 4
    assert (one.makespan, two.makespan) == (33.0, 31.0)


def test_resolve_adds_a_reduction_after_each_stages_last_weight_gradient():
    s = prepare("chimera", n_ranks=2, n_microbatches=4, two_bp=True)
    for rank, acts in s.actions.items():
        for stage in s.stages_of(rank):
            own = [
                a
                for a in acts
                if a.stage == stage
                and a.kind in (Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD, Kind.REDUCE)
            ]
            assert own[-1] == Action(stage, Kind.REDUCE, tuple(s.microbatches_of(stage)))
    assert without_reductions(s) != s and add_reductions(without_reductions(s)) == s
    lowered = add_communication(s)
    validate(lowered)
    # R moves nothing between the pipeline's ranks: the same sends and receives, in the
    # same pair order, as without it.
    plain = add_communication(without_reductions(s))
    assert without_reductions(lowered) == plain
    for rank in s.actions:
        assert plan_communication(lowered, rank) == plan_communication(plain, rank)
        assert plan_communication(lowered, rank).peers


def test_a_reduction_must_cover_its_stage_once():
    s = add_reductions(generate("1f1b", 2, 2))
    validate(s)
    rows = [[c.replace("1R0-1", "1R0") for c in row] for row in to_rows(s)]
    with pytest.raises(ScheduleError, match=r"stage 1: its gradient reduction must be one 1R0-1"):
        validate(from_rows(rows))


def test_csv_keeps_the_two_pipelines():
    s = prepare("chimera", n_ranks=4, n_microbatches=8, two_bp=True)
    back = from_rows(to_rows(s), name=s.name)
    assert back == s and back.n_pipelines == 2
