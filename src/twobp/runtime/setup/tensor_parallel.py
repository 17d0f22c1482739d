"""Tensor parallelism under the pipeline: ``T`` pipelines in lockstep, their blocks split.

``Pipeline(tensor_parallel=T)`` lays the world out ``dp x pp x tp``, tensor
parallel innermost: global rank ``r`` is tensor-parallel rank ``r % T`` of the
group ``r - r % T, ..., r - r % T + T - 1`` (adjacent ranks, one machine). The
ranks of one tensor-parallel rank form a pipeline of their own (``D x P``
ranks, data parallel within it as usual): the pipeline's transfers, its
reductions over the copies and its tied weights stay between ranks of the same
shard. Each block is split over its tensor-parallel group after planning
(:func:`twobp.models.shard_block`): its column-parallel linears all-reduce their
input gradient in ``I``, its row-parallel ones (and a vocabulary-split embedding)
their output in ``F``, a gathered head gathers its logits in ``F``, and every
weight gradient is local, deferred to ``W`` as without tensor parallelism. A weight
tied across pipeline ranks (a head tied to the embedding) is split once; each
shard's tie is reduced within its own pipeline, as any tie.

The ``T`` pipelines run the same schedule on the same batches; every rank of a
tensor-parallel group computes the same loss. What must agree over all ranks
does: the gradient norm (each shard counted once, a replicated parameter once)
and a ``GradScaler``'s overflow.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch import nn

from twobp.runtime.base.group import Membership
from twobp.runtime.base.process_state import even_out, is_made, shared_group
from twobp.runtime.base.tensor_split import SPLIT_STYLE
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import PipelineOptions, check_size
from twobp.runtime.setup.data_parallel import group_rank

Plan = Mapping[str, Any] | Callable[[int, nn.Module], Mapping[str, Any]]
"""Module-name pattern -> a style of :data:`twobp.models.tensor_parallel.STYLES` (or torch's
``ColwiseParallel()`` / ``RowwiseParallel()``), or ``(block index, block) -> that``."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel layout.

    Args:
        size: ranks per tensor-parallel group ``T``.
        rank: this rank's index in its group.
        group: the tensor-parallel process group.
        world: the group every rank of every pipeline belongs to.
        pipeline_group: the process group of this rank's pipeline (one shard's).
    """

    size: int
    rank: int
    group: dist.ProcessGroup
    world: Membership
    pipeline_group: dist.ProcessGroup

    @property
    def place(self) -> tuple[int, int]:
        """``(rank, size)``."""
        return self.rank, self.size


def check_world(size: int, tensor_parallel: int) -> None:
    """Refuse a world that is not ``D x P x T`` ranks.

    Raises:
        PipelineConfigError: naming the sizes.
    """
    check_size(tensor_parallel)
    if size % tensor_parallel:
        raise PipelineConfigError(
            f"tensor_parallel={tensor_parallel}: a world of {size} ranks is not "
            f"data_parallel x pipeline x {tensor_parallel} ranks; start a multiple of "
            f"{tensor_parallel} processes or change tensor_parallel"
        )


def layout(members: Membership, tensor_parallel: int, timeout: float) -> TensorParallel:
    """Make the tensor-parallel groups and the pipelines' groups. Collective over the world:
    every rank makes every group, in one order.

    Raises:
        PipelineConfigError: a world that does not divide, or a group other than the world.
    """
    check_world(members.size, tensor_parallel)
    if members.group is not None and members.group is not dist.group.WORLD:
        raise PipelineConfigError(
            "tensor_parallel: the pipelines and their tensor-parallel groups are made over "
            "the default group; pass group=None"
        )
    size, me = members.size, members.rank
    groups: dict[str, list[int]] = {}
    for t in range(tensor_parallel):
        groups[f"tensor-parallel pipeline {t}/{tensor_parallel}"] = list(
            range(t, size, tensor_parallel)
        )
    for base in range(0, size, tensor_parallel):
        groups[f"tensor-parallel group {base}/{tensor_parallel}"] = list(
            range(base, base + tensor_parallel)
        )
    made, mine = [], {}
    for key, ranks in groups.items():
        if not is_made(key, ranks, timeout, every_rank=True):
            made.append(ranks)
        group = shared_group(key, ranks, timeout, every_rank=True)
        if group is not None:
            mine[key] = group
    even_out(made, me, timeout)
    rank = me % tensor_parallel
    return TensorParallel(
        size=tensor_parallel,
        rank=rank,
        group=mine[f"tensor-parallel group {me - rank}/{tensor_parallel}"],
        world=members,
        pipeline_group=mine[f"tensor-parallel pipeline {rank}/{tensor_parallel}"],
    )


def style_name(pattern: str, style: Any) -> str:
    """The name of a style of a plan: the name itself, or torch's ``ColwiseParallel()`` /
    ``RowwiseParallel()`` with their default layouts (``"colwise"`` / ``"rowwise"``;
    ``RowwiseParallel()`` on an embedding splits its vocabulary, as in torch), or
    ``ColwiseParallel(output_layouts=Replicate())`` (``"colwise_gather_output"``), or
    ``ColwiseParallel(use_local_output=False)`` (``"colwise_loss_parallel"``, a head's logits
    left split for the loss, as torchtitan's ``loss_parallel``).

    Raises:
        PipelineConfigError: another ``ParallelStyle`` (``SequenceParallel``, other
            layouts), naming the entry.
    """
    if isinstance(style, str):
        return style
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layouts = (
        tuple(getattr(style, "input_layouts", ()) or ()),
        tuple(getattr(style, "output_layouts", ()) or ()),
    )
    if type(style) is ColwiseParallel and layouts == ((Replicate(),), (Shard(-1),)):
        # torchtitan's head under loss_parallel keeps its DTensor logits split.
        return "colwise" if style.use_local_output else "colwise_loss_parallel"
    if type(style) is ColwiseParallel and layouts == ((Replicate(),), (Replicate(),)):
        return "colwise_gather_output"
    if type(style) is RowwiseParallel and layouts == ((Shard(-1),), (Replicate(),)):
        return "rowwise"
    raise PipelineConfigError(
        f"tensor_parallel_plan: {pattern!r}: {type(style).__name__} with input layouts "
        f"{layouts[0]} and output layouts {layouts[1]} is not supported; give 'colwise', "
        "'rowwise' or 'colwise_gather_output' (ColwiseParallel() or RowwiseParallel() with "
        "their defaults, ColwiseParallel(output_layouts=Replicate())); sequence parallelism "
        "is not there yet"
    )


def block_plan(plan: Plan, index: int, block: nn.Module) -> dict[str, str]:
    """What ``plan`` splits of block ``index``: a callable's answer, or the entries of a
    mapping that name modules of this block (embeddings and heads have none); torch's
    styles named as :func:`style_name` does."""
    if callable(plan):
        return {p: style_name(p, s) for p, s in plan(index, block).items()}
    names = [n for n, _ in block.named_modules() if n]
    return {
        p: style_name(p, s)
        for p, s in plan.items()
        if any(fnmatch.fnmatchcase(n, p) for n in names)
    }


def block_plans(blocks: Sequence[nn.Module], plan: Plan) -> list[dict[str, str]]:
    """What ``plan`` splits of each block (:func:`block_plan`).

    Raises:
        PipelineConfigError: an entry of a mapping that names no module of any block.
    """
    plans = [block_plan(plan, i, b) for i, b in enumerate(blocks)]
    if not callable(plan):
        unused = [p for p in plan if not any(p in chosen for chosen in plans)]
        if unused:
            raise PipelineConfigError(
                f"tensor_parallel_plan: {', '.join(repr(p) for p in unused)} names no module "
                "of any block; name modules as block.named_modules() does (e.g. 'attn.wq')"
            )
    return plans


def shard_blocks(blocks: Sequence[nn.Module], plan: Plan, tp: TensorParallel) -> None:
    """Split every block over this rank's tensor-parallel group, in place (a weight tied
    across blocks once: :func:`twobp.models.tensor_parallel.shard_blocks`), and mark each
    split module with its style.

    Raises:
        PipelineConfigError: an entry of a mapping that names no module of any block, or
            what :func:`twobp.models.shard_block` refuses (a width, a vocabulary or a head
            count that does not divide by ``T``, a tied weight split two ways), naming the
            block and the module.
    """
    from twobp.models.tensor_parallel import shard_blocks as split_blocks

    plans = block_plans(blocks, plan)
    try:
        styles = split_blocks(blocks, plans, tp.group)
    except ValueError as exc:
        raise PipelineConfigError(str(exc)) from exc
    for block, split in zip(blocks, styles, strict=True):
        modules = dict(block.named_modules())
        for name, style in split.items():
            setattr(modules[name], SPLIT_STYLE, style)


TP_MESH_DIMS = (("dp", "pp", "tp"), ("pp", "tp"))
"""The dims of a ``DeviceMesh`` that lays out tensor parallelism (``mesh=``)."""


def refuse_mesh(mesh: Any, tensor_parallel: object) -> None:
    """Refuse a mesh without a ``"tp"`` dim given with ``tensor_parallel`` (a size or a
    range of them; :func:`from_mesh` reads a mesh with one).

    Raises:
        PipelineConfigError: if ``mesh`` is not None.
    """
    if mesh is not None:
        raise PipelineConfigError(
            f"tensor_parallel={tensor_parallel!r} with a mesh= of dims "
            f"{getattr(mesh, 'mesh_dim_names', None)}: give a mesh with dims ('dp', 'pp', "
            "'tp') for one size, or data_parallel and tensor_parallel without a mesh "
            "(the ranks are laid out dp x pp x tp)"
        )


def from_mesh(options: PipelineOptions, mesh: Any, members: Membership) -> tuple[Any, Any]:
    """``options`` with ``data_parallel`` and ``tensor_parallel`` read from a ``mesh`` with
    a ``"tp"`` dim (dims ``("dp", "pp", "tp")`` or ``("pp", "tp")``), and no mesh left to
    lay out the copies; ``(options, mesh)`` as they are for any other mesh or none.

    The mesh must lay the ranks out as twobp does, ``dp x pp x tp`` with ``tp``
    innermost: the rank at ``(d, p, t)`` is group rank ``(d * P + p) * T + t``, as
    ``init_device_mesh(device_type, (D, P, T), mesh_dim_names=("dp", "pp", "tp"))``
    makes it.

    Raises:
        PipelineConfigError: on every rank alike, if the dims are others, the layout is
            another, or ``data_parallel`` or ``tensor_parallel`` given besides disagree.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
    if "tp" not in names:
        return options, mesh
    if names not in TP_MESH_DIMS:
        raise PipelineConfigError(
            f"mesh= with a 'tp' dim must have dims ('dp', 'pp', 'tp') or ('pp', 'tp'), got "
            f"{names}; build it with init_device_mesh(device_type, (D, P, T), "
            "mesh_dim_names=('dp', 'pp', 'tp'))"
        )
    shape = tuple(int(n) for n in mesh.mesh.shape)
    copies, _, size = shape if len(shape) == 3 else (1, *shape)
    read = {"data_parallel": copies, "tensor_parallel": size}
    for name, value in read.items():
        given = getattr(options, name)
        if given is not None and given != value:
            raise PipelineConfigError(
                f"{name}={given!r} but the mesh {dict(zip(names, shape, strict=True))} "
                f"says {value}: pass the mesh alone"
            )
    ranks = [group_rank(members, int(r)) for r in mesh.mesh.flatten().tolist()]
    if ranks != list(range(members.size)):
        raise PipelineConfigError(
            f"mesh= lays the ranks out as {mesh.mesh.tolist()}; twobp lays them out dp x pp x "
            "tp with tp innermost (group rank (d * P + p) * T + t), as init_device_mesh("
            "device_type, (D, P, T), mesh_dim_names=('dp', 'pp', 'tp')) does: build the mesh "
            "so, or pass data_parallel and tensor_parallel"
        )
    return replace(options, data_parallel=copies, tensor_parallel=size), None


def tensor_parallel_layout(
    members: Membership, options: Any, mesh: Any, example_input: Any
) -> TensorParallel | None:
    """This rank's tensor-parallel layout (None for ``tensor_parallel`` None or 1).
    Collective over the world.

    Raises:
        PipelineConfigError: a mesh or an example input given with it (each pipeline
            would plan apart), or what :func:`layout` refuses.
    """
    size = options.tensor_parallel
    if size is None or size == 1:
        return None
    assert isinstance(size, int), "a range of sizes is decided before the layout"
    refuse_mesh(mesh, size)
    if example_input is not None:
        raise PipelineConfigError(
            "tensor_parallel with example_input: each tensor-parallel pipeline would profile "
            "and plan apart; leave example_input out and give the partition"
        )
    return layout(members, size, float(options.timeout))
