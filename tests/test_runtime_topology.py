"""The map from the schedule's pipeline ranks to the group's ranks (no processes)."""

from __future__ import annotations

import pytest

from twobp.runtime.base.group import Membership
from twobp.runtime.base.topology import Topology


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


def test_copies_of_a_chimera_pipeline_hold_every_stage_four_times():
    from twobp.schedule import generate

    schedule = generate("chimera", 2, 4)  # stages 0, 1 down on ranks 0, 1; 2, 3 up on 1, 0
    grid = [[0, 1], [2, 3]]
    topology = Topology.replicated(_members(3, 4), schedule, grid)
    assert (topology.dp_rank, topology.dp_size, topology.pp_rank) == (1, 2, 1)
    assert topology.stages_here == (1, 2)
    # Model stage 0 (stages 0 and 2): copy 0's ranks first, the down pipeline's first.
    assert topology.replicas(0) == topology.replicas(2) == (0, 1, 2, 3)
    assert topology.replicas(1) == (1, 0, 3, 2)
    assert not topology.writes_stage_files  # copy 1 writes nothing
    writer = Topology.replicated(_members(1, 4), schedule, grid)
    assert writer.written_stages == (1,)  # its down stage; rank 0 writes model stage 0
    with pytest.raises(ValueError, match="must hold every rank of the group of 4 exactly once"):
        Topology.replicated(_members(0, 4), schedule, [[0, 1], [1, 3]])


def test_a_data_parallel_grid_or_mesh_that_does_not_fit_is_refused():
    import torch

    from twobp.runtime.errors import PipelineConfigError
    from twobp.runtime.setup.data_parallel import data_parallel_grid

    assert data_parallel_grid(_members(0, 6), 3, None) == [[0, 1], [2, 3], [4, 5]]
    assert data_parallel_grid(_members(0, 2), None, None) == [[0, 1]]
    with pytest.raises(PipelineConfigError, match="a group of 6 ranks does not form 4 copies"):
        data_parallel_grid(_members(0, 6), 4, None)

    class Mesh:  # the two attributes of a DeviceMesh that the grid reads
        def __init__(self, names, ranks):
            self.mesh_dim_names = names
            self.mesh = torch.tensor(ranks)

    assert data_parallel_grid(_members(0, 4), None, Mesh(("dp", "pp"), [[0, 2], [1, 3]])) == [
        [0, 2],
        [1, 3],
    ]
    with pytest.raises(PipelineConfigError, match=r"dims \('dp', 'pp'\).*got dims \('pp', 'dp'\)"):
        data_parallel_grid(_members(0, 4), None, Mesh(("pp", "dp"), [[0, 1], [2, 3]]))
    with pytest.raises(PipelineConfigError, match="data_parallel=4 but the mesh has 2 rows"):
        data_parallel_grid(_members(0, 4), 4, Mesh(("dp", "pp"), [[0, 1], [2, 3]]))
