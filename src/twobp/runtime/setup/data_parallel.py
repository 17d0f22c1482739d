"""Copies of a pipeline side by side: the grid of ranks, and the reducer of their gradients.

With ``data_parallel=D`` a group of ``D x P`` ranks runs ``D`` copies of a
pipeline of ``P`` ranks: copy ``d`` runs pipeline rank ``r`` on group rank
``d * P + r``, the layout of a ``DeviceMesh`` of shape ``(D, P)`` with dims
``("dp", "pp")``. A mesh passed as ``mesh=`` gives its own layout.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from twobp.runtime.base.group import Membership
from twobp.runtime.base.process_state import even_out, is_made, mark_made, reduction_group
from twobp.runtime.base.topology import Topology
from twobp.runtime.communication.reduction import Bucket, GradientReducer, buckets
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.setup.replicas import SharedParameter, reduction_groups
from twobp.schedule.lowering import makes_weight_gradients
from twobp.schedule.schedule import Schedule

MESH_DIMS = ("dp", "pp")
"""The names a 2-D ``DeviceMesh`` must give its dims: data parallel, then pipeline."""


def data_parallel_grid(
    members: Membership, data_parallel: int | None, mesh: Any
) -> list[list[int]]:
    """The group ranks of every copy of the pipeline: ``grid[d][r]``.

    Args:
        members: this process's group.
        data_parallel: the number of copies ``D`` (None: from the mesh, or 1).
        mesh: a 2-D ``torch.distributed.device_mesh.DeviceMesh`` with dims
            ``("dp", "pp")``, or None.

    Raises:
        PipelineConfigError: the same on every rank, if ``D`` is not a
            positive divisor of the group's size, the mesh has other dims,
            disagrees with ``data_parallel`` or does not cover the group.
    """
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if names != MESH_DIMS:
            raise PipelineConfigError(
                f"mesh= must be a 2-D DeviceMesh with dims {MESH_DIMS} (data parallel, then "
                f"pipeline), got dims {names or 'without names'}; build it with "
                "init_device_mesh(device_type, (D, P), mesh_dim_names=('dp', 'pp'))"
            )
        grid = [[group_rank(members, int(r)) for r in row] for row in mesh.mesh.tolist()]
        if data_parallel is not None and data_parallel != len(grid):
            raise PipelineConfigError(
                f"data_parallel={data_parallel} but the mesh has {len(grid)} rows along 'dp'; "
                "pass one of them"
            )
        if sorted(r for row in grid for r in row) != list(range(members.size)):
            raise PipelineConfigError(
                f"the mesh {mesh.mesh.tolist()} must hold every rank of the pipeline's group "
                f"of {members.size} exactly once"
            )
        return grid
    copies = 1 if data_parallel is None else data_parallel
    if not isinstance(copies, int) or copies < 1 or members.size % copies:
        raise PipelineConfigError(
            f"data_parallel={data_parallel}: a group of {members.size} ranks does not form "
            f"{data_parallel} copies of a pipeline (the world must be data_parallel x pipeline "
            "ranks); start D x P processes or change data_parallel"
        )
    width = members.size // copies
    return [[d * width + r for r in range(width)] for d in range(copies)]


def group_rank(members: Membership, global_rank: int) -> int:
    """The rank in ``members``' group of the process of global rank ``global_rank``."""
    group = members.group
    if group is None:
        return global_rank
    return int(dist.get_group_rank(group, global_rank))


def make_reducer(
    members: Membership,
    topology: Topology,
    schedule: Schedule,
    stage_modules: dict[int, nn.Module],
    shared: dict[int, SharedParameter],
    timeout: float,
) -> GradientReducer | None:
    """The reducer of this rank's replicated gradients, or None if nothing is replicated.

    Collective over each reduction's ranks: every rank creates the process
    groups it belongs to, in one order.

    Args:
        members: this process's group.
        topology: where each stage runs.
        schedule: the schedule this rank runs (its order places each tied
            parameter's reduction at the ``R`` of its last stage here).
        stage_modules: this rank's stages' modules, by stage.
        shared: the parameters used by several model stages, by ``id``.
        timeout: seconds a reduction may wait for the other ranks.
    """
    groups = reduction_groups(schedule, topology, shared)
    if not groups:
        return None
    made: dict[str, dist.ProcessGroup] = {}
    new: list[list[int]] = []
    for group in groups:
        ranks = [members.global_rank(r) for r in group.ranks]
        if members.rank in group.ranks:
            if not is_made(group.key, ranks, timeout):
                new.append(ranks)
            made[group.key] = reduction_group(group.key, ranks, timeout)
        elif mark_made(group.key, ranks, timeout):
            new.append(ranks)
    if members.size == dist.get_world_size() and members.group is dist.group.WORLD:
        # The next groups made by their ranks alone (a later pipeline's) need every rank
        # to belong to as many groups as the others (see process_state.even_out).
        even_out(new, members.global_rank(members.rank), timeout)
    # The R of a parameter: the last of its stages here, in this rank's order.
    order = [a.stage for a in schedule.actions[topology.pp_rank] if makes_weight_gradients(a.kind)]
    last = {s: max(i for i, x in enumerate(order) if x == s) for s in stage_modules}
    chosen: dict[int, tuple[int, str, nn.Parameter]] = {}
    for stage, module in stage_modules.items():
        for p in module.parameters():
            tie = shared.get(id(p))
            key = f"tied {tie.name}" if tie is not None else f"stage {schedule.model_stage(stage)}"
            if key not in made:
                continue
            seen = chosen.get(id(p))
            if seen is None or last[stage] > last[seen[0]]:
                chosen[id(p)] = (stage, key, p)
    by_stage: dict[int, list[Bucket]] = {s: [] for s in stage_modules}
    for stage in stage_modules:
        for key, process_group in made.items():
            params = [p for s, k, p in chosen.values() if s == stage and k == key]
            floats: list[Tensor] = []
            if key == f"stage {schedule.model_stage(stage)}":
                floats = [b for b in stage_modules[stage].buffers() if b.is_floating_point()]
            if params or floats:
                by_stage[stage] += buckets(key, process_group, params, floats)
    return GradientReducer(members.rank, by_stage, topology.dp_size, timeout)
