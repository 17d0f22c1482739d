"""Which parameters tensor parallelism split, for the floors that count or save them.

:mod:`twobp.runtime.setup.tensor_parallel` marks each split module with
:data:`SPLIT_STYLE` (a module's attributes survive the copies a pipeline makes
of its blocks; a parameter's do not). A norm over every rank counts each shard
once and a replicated parameter once; a state dict of shards is refused (a checkpoint
writes each rank's shards as DTensors: :mod:`twobp.runtime.state.checkpoint.tensor_shards`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from twobp.runtime.errors import PipelineConfigError

SPLIT_STYLE = "_twobp_tensor_parallel_style"
"""The attribute a split module carries: its style (``"colwise"``, ``"rowwise"``,
``"colwise_gather_output"``, ``"colwise_loss_parallel"``, ``"embedding_rowwise"``)."""


def split_dims(model: nn.Module) -> dict[int, int]:
    """The split parameters of ``model``, by ``id``: the dim their shards are cut along."""
    dims = {}
    for module in model.modules():
        style = getattr(module, SPLIT_STYLE, None)
        if style is None:
            continue
        for name, param in module.named_parameters(recurse=False):
            dims[id(param)] = 1 if style == "rowwise" and name == "weight" else 0
    return dims


def counted_once(
    params: Sequence[nn.Parameter], tp_rank: int, model: nn.Module
) -> list[nn.Parameter]:
    """Of ``params`` (of ``model``), those whose gradient this rank counts in a norm over
    all ranks: its shards, and a replicated parameter on tensor-parallel rank 0 only."""
    split = split_dims(model)
    return [p for p in params if id(p) in split or tp_rank == 0]


def refuse_checkpoint(tensor_parallel: Any) -> None:
    """Refuse a state dict of split blocks, whose entries would hold one shard under the
    whole parameter's name.

    Raises:
        PipelineConfigError: with tensor parallelism (``tensor_parallel`` not None).
    """
    if tensor_parallel is not None:
        raise PipelineConfigError(
            "state_dict() of a tensor-parallel pipeline is refused: each rank holds one shard "
            "of its split linears under the whole parameter's name; save() and load() write "
            "and read each rank's shards (DTensors), and twobp checkpoint merge gives the "
            "whole tensors"
        )
