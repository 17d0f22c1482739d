"""The world a pipeline joins: its tensor-parallel size, its groups, what it plans with.

With one ``tensor_parallel`` size (or none), the groups of that layout are made at once
(:func:`twobp.runtime.setup.tensor_parallel.layout`). With a range of sizes under
``schedule="auto"``, the size and the plan are decided first, over the whole world
(:func:`twobp.runtime.setup.auto.tensor_size.decide_size`), and the groups made for the
size chosen; the pipeline then runs that plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from twobp.runtime.base.group import Membership, join_world
from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import Batch, PipelineOptions
from twobp.runtime.setup.auto.tensor_size import decide_size
from twobp.runtime.setup.fingerprint import stable_hash
from twobp.runtime.setup.first_step import Given
from twobp.runtime.setup.tensor_parallel import (
    TensorParallel,
    from_mesh,
    refuse_mesh,
    tensor_parallel_layout,
)


def join_shard(
    device: torch.device,
    group: dist.ProcessGroup | None,
    options: PipelineOptions,
    mesh: Any,
    example_input: Batch | None,
    blocks: object,
) -> tuple[Membership, Membership, TensorParallel | None, Given]:
    """The world this rank joins, the membership of its pipeline (with tensor
    parallelism: the ranks of its shard; else the world), its tensor-parallel layout
    (None without) and what the pipeline plans with (the options at the size decided,
    and the plan of a range). Collective over the world.

    Raises:
        PipelineConfigError: on every rank, what :func:`decide_size` or
            :func:`tensor_parallel_layout` refuses, or ranks given other
            ``tensor_parallel`` sizes (:func:`same_tensor_parallel`).
    """
    timeout = float(options.timeout)
    world = join_world(device, timeout, group)
    options, mesh = from_mesh(options, mesh, world)
    same_tensor_parallel(world, device, timeout, options.tensor_parallel)
    decided = None
    if not isinstance(options.tensor_parallel, int | None):
        refuse_mesh(mesh, options.tensor_parallel)
        options, decided = decide_size(blocks, options, world, device, example_input)
        example_input = None  # planned: each shard's pipeline runs the plan as it is
    tp = tensor_parallel_layout(world, options, mesh, example_input)
    given = Given(options, example_input, group, mesh, decided)
    if tp is None:
        return world, world, None, given
    return world, join_world(device, timeout, tp.pipeline_group), tp, given


_RANGE = 1 << 61
"""Codes of ``tensor_parallel`` ranges start here (a size is its own code)."""


def same_tensor_parallel(
    world: Membership, device: torch.device, timeout: float, size: int | Sequence[int] | None
) -> None:
    """Fail on every rank, naming each rank's size, unless every rank of ``world`` was given
    the same ``tensor_parallel`` (a size, None as 1, or the same range). Collective.

    The ranks make their groups from it: given other sizes, they would wait for each
    other's groups until the timeout.

    Raises:
        PipelineConfigError: on every rank, if two ranks were given other sizes.
    """
    if size is None or isinstance(size, int):
        code = 1 if size is None else size
    else:
        code = _RANGE | stable_hash(repr(sorted(size))) % _RANGE
    codes = [
        row[0] for row in agree(world, device, timeout, None, "comparing tensor_parallel", [code])
    ]
    if len(set(codes)) == 1:
        return
    given = ", ".join(f"rank {r}: {c if c < _RANGE else 'a range'}" for r, c in enumerate(codes))
    raise PipelineConfigError(
        f"rank {world.rank}: the ranks were given other tensor_parallel sizes ({given}; "
        "none counts as 1); give every rank the same"
    )
