"""The map from the schedule's pipeline ranks to the group's ranks (no processes)."""

from __future__ import annotations

import pytest

from twobp.runtime.setup.group import Membership
from twobp.runtime.setup.topology import Topology


def _members(rank: int, size: int) -> Membership:
    # A group reference is only followed to communicate; these tests do not.
    return Membership(rank, size, size, None, None)


def test_one_pipeline_maps_pipeline_ranks_onto_group_ranks():
    topology = Topology.one_pipeline(_members(1, 2), (0, 1, 1, 0))
    assert topology.pp_rank == 1 and topology.pp_size == 2
    assert topology.stages_here == (1, 2)
    assert [topology.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    assert topology.replicas(3) == (0,)
    assert topology.writes_stage_files


def test_two_pipelines_keep_pipeline_and_group_ranks_apart():
    # Group ranks 2 and 3 run a second copy of a 2-stage pipeline.
    stage_ranks = ((0, 2), (1, 3))
    second = Topology(_members(3, 4), (0, 1), (2, 3), stage_ranks)
    assert second.pp_rank == 1 and second.rank == 3
    assert second.rank_of_stage(0) == 2 and second.group_rank(1) == 3
    assert second.stages_here == (1,)
    assert not second.writes_stage_files  # rank 1 writes stage 1's file
    first = Topology(_members(1, 4), (0, 1), (0, 1), stage_ranks)
    assert first.pp_rank == 1 and first.writes_stage_files


def test_maps_that_disagree_are_refused():
    with pytest.raises(ValueError, match="places its stages on 2 ranks but the group has 4"):
        Topology.one_pipeline(_members(0, 4), (0, 1))
    with pytest.raises(ValueError, match="2 stage replica lists for 3 stages"):
        Topology(_members(0, 2), (0, 1, 1), (0, 1), ((0,), (1,)))
    with pytest.raises(ValueError, match="group rank 5 is not in a group of 2"):
        Topology(_members(0, 2), (0, 1), (0, 5), ((0,), (5,)))
