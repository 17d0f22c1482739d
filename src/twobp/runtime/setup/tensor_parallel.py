"""Tensor parallelism under the pipeline: ``T`` pipelines in lockstep, their blocks split.

``Pipeline(tensor_parallel=T)`` lays the world out ``dp x pp x tp``, tensor
parallel innermost: global rank ``r`` is tensor-parallel rank ``r % T`` of the
group ``r - r % T, ..., r - r % T + T - 1`` (adjacent ranks, one machine). The
ranks of one tensor-parallel rank form a pipeline of their own (``D x P``
ranks, data parallel within it as usual): the pipeline's transfers, its
reductions over the copies and its tied weights stay between ranks of the same
shard. Each block is split over its tensor-parallel group after planning
(:func:`twobp.models.shard_block`): its column-parallel linears all-reduce their
input gradient in ``I``, its row-parallel ones their output in ``F``, and every
weight gradient is local, deferred to ``W`` as without tensor parallelism.

The ``T`` pipelines run the same schedule on the same batches; every rank of a
tensor-parallel group computes the same loss. What must agree over all ranks
does: the gradient norm (each shard counted once, a replicated parameter once)
and a ``GradScaler``'s overflow.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from twobp.runtime.base.group import Membership
from twobp.runtime.base.process_state import even_out, is_made, shared_group
from twobp.runtime.errors import PipelineConfigError

Plan = Mapping[str, Any] | Callable[[int, nn.Module], Mapping[str, Any]]
"""Module-name pattern -> ``"colwise"``/``"rowwise"`` (or torch's ``ColwiseParallel()`` /
``RowwiseParallel()``), or ``(block index, block) -> that``."""

SPLIT_STYLE = "_twobp_tensor_parallel_style"
"""The attribute a split linear carries (a module's attributes survive the copies a
pipeline makes of its blocks; a parameter's do not): ``"colwise"`` or ``"rowwise"``."""


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


def check_size(tensor_parallel: object) -> None:
    """Refuse a ``tensor_parallel`` that is not a count of ranks.

    Raises:
        PipelineConfigError: naming the value.
    """
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise PipelineConfigError(
            f"tensor_parallel={tensor_parallel!r}: give the number of ranks each block is "
            "split over, an int >= 1"
        )


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
    """``"colwise"`` or ``"rowwise"`` for a style of a plan: the name itself, or torch's
    ``ColwiseParallel()`` / ``RowwiseParallel()`` with their default layouts.

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
        return "colwise"
    if type(style) is RowwiseParallel and layouts == ((Shard(-1),), (Replicate(),)):
        return "rowwise"
    raise PipelineConfigError(
        f"tensor_parallel_plan: {pattern!r}: {type(style).__name__} with input layouts "
        f"{layouts[0]} and output layouts {layouts[1]} is not supported; give 'colwise' or "
        "'rowwise' (ColwiseParallel() or RowwiseParallel() with their defaults); sequence "
        "parallelism is not there yet"
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


def shard_blocks(blocks: Sequence[nn.Module], plan: Plan, tp: TensorParallel) -> None:
    """Split every block over this rank's tensor-parallel group, in place.

    Raises:
        PipelineConfigError: an entry of a mapping that names no module of any block, or
            what :func:`twobp.models.shard_block` refuses (a width or a head count that
            does not divide by ``T``), naming the block and the module.
    """
    from twobp.models.tensor_parallel import shard_block

    plans = [block_plan(plan, i, b) for i, b in enumerate(blocks)]
    if not callable(plan):
        unused = [p for p in plan if not any(p in chosen for chosen in plans)]
        if unused:
            raise PipelineConfigError(
                f"tensor_parallel_plan: {', '.join(repr(p) for p in unused)} names no module "
                "of any block; name modules as block.named_modules() does (e.g. 'attn.wq')"
            )
    for index, (block, chosen) in enumerate(zip(blocks, plans, strict=True)):
        if not chosen:
            continue
        try:
            shard_block(block, chosen, tp.group)
        except ValueError as exc:
            raise PipelineConfigError(f"block {index}: {exc}") from exc
        for name, module in block.named_modules():
            style = next(
                (s for p, s in chosen.items() if name and fnmatch.fnmatchcase(name, p)), None
            )
            if style is not None:
                setattr(module, SPLIT_STYLE, style)


def split_dims(model: nn.Module) -> dict[int, int]:
    """The split parameters of ``model``, by ``id``: the dim their shards are cut along."""
    dims = {}
    for module in model.modules():
        style = getattr(module, SPLIT_STYLE, None)
        if style is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            dims[id(param)] = 0 if style == "colwise" or name == "bias" else 1
    return dims


def counted_once(
    params: Sequence[nn.Parameter], tp: TensorParallel, model: nn.Module
) -> list[nn.Parameter]:
    """Of ``params`` (of ``model``), those whose gradient this rank counts in a norm over
    all ranks: its shards, and a replicated parameter on tensor-parallel rank 0 only."""
    split = split_dims(model)
    return [p for p in params if id(p) in split or tp.rank == 0]


def refuse_planning_apart(options: Any) -> None:
    """Refuse what each pipeline would plan from its own measurements (the ``T``
    pipelines must run one plan).

    Raises:
        PipelineConfigError: naming the option and what to give.
    """
    from twobp.runtime.options import PROFILE

    apart = {
        "schedule='auto'": options.schedule == "auto",
        "n_microbatches='auto'": options.n_microbatches == "auto",
        "partition='balanced'": options.partition == "balanced",
        "costs='profile'": isinstance(options.costs, str) and options.costs == PROFILE,
        "recompute='auto'": options.rebuilds,
    }
    chosen = [name for name, on in apart.items() if on]
    if chosen:
        raise PipelineConfigError(
            f"tensor_parallel: {', '.join(chosen)} plans from what each tensor-parallel "
            "pipeline would measure apart; give a schedule by name, n_microbatches as a number "
            "and a partition (or None)"
        )


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
    if mesh is not None:
        raise PipelineConfigError(
            "tensor_parallel with mesh=: pass data_parallel and tensor_parallel instead "
            "(the ranks are laid out dp x pp x tp)"
        )
    if example_input is not None:
        raise PipelineConfigError(
            "tensor_parallel with example_input: each tensor-parallel pipeline would profile "
            "and plan apart; leave example_input out and give the partition"
        )
    return layout(members, size, float(options.timeout))


def refuse_checkpoint(tp: TensorParallel | None) -> None:
    """Refuse a checkpoint of split blocks, whose entries hold one shard under the whole
    parameter's name.

    Raises:
        PipelineConfigError: with tensor parallelism.
    """
    if tp is not None:
        raise PipelineConfigError(
            "checkpoints of a tensor-parallel pipeline are not supported: each rank holds "
            "one shard of its split linears under the whole parameter's name; train with "
            "tensor_parallel=None to save and load"
        )
