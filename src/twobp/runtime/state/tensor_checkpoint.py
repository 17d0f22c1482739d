"""Checkpoints of a tensor-parallel pipeline, as of the whole model.

A checkpoint holds every parameter whole under its single-process name, so it
loads at any tensor-parallel size, pipeline size or number of copies, and
without tensor parallelism. To save, every rank joins its split parameters
(and their optimizer state) over its tensor-parallel group, and the pipeline
of shard 0 writes them as a pipeline without tensor parallelism would; to load,
every pipeline reads the whole tensors and each rank keeps its shard. The
joined tensors stand in for the shards only while the checkpoint code reads or
fills them (the parameters' ``data`` and the optimizer's state tensors are
swapped, and swapped back).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from twobp.runtime.base.tensor_split import split_dims


def _split_parameters(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """The split parameters of ``module`` with their dims, in one order on every shard."""
    dims = split_dims(module)
    return [(p, dims[id(p)]) for p in module.parameters() if id(p) in dims]


def _states(optimizer: torch.optim.Optimizer | None, param: nn.Parameter) -> dict[str, Any]:
    if optimizer is None:
        return {}
    state = optimizer.state.get(param)
    return state if isinstance(state, dict) else {}


def _join(shard: Tensor, dim: int, tp: Any) -> Tensor:
    pieces = [torch.empty_like(shard) for _ in range(tp.size)]
    dist.all_gather(pieces, shard.contiguous(), group=tp.group)
    return torch.cat(pieces, dim=dim)


@contextmanager
def joined(module: nn.Module, optimizer: torch.optim.Optimizer | None, tp: Any) -> Iterator[None]:
    """While inside, every split parameter of ``module`` (and each optimizer state tensor
    of its shape) holds the whole tensor. Collective over the tensor-parallel group."""
    swapped: list[tuple[nn.Parameter, Tensor, dict[str, Tensor]]] = []
    try:
        with torch.no_grad():
            for param, dim in _split_parameters(module):
                shard = param.data
                state = _states(optimizer, param)
                kept = {
                    k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == shard.shape
                }
                for key, value in kept.items():
                    state[key] = _join(value, dim, tp)
                param.data = _join(shard, dim, tp)
                swapped.append((param, shard, kept))
        yield
    finally:
        for param, shard, kept in swapped:
            param.data = shard
            _states(optimizer, param).update(kept)


@contextmanager
def whole_then_shards(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, tp: Any
) -> Iterator[None]:
    """While inside, every split parameter of ``module`` has the whole shape (to be filled
    by a load); on leaving, each keeps its shard of what was loaded, and so does each
    optimizer state tensor of the whole shape. A failure inside puts the shards back."""
    split = _split_parameters(module)
    shards = {id(p): p.data for p, _ in split}
    loaded = False
    try:
        for param, dim in split:
            shape = list(param.shape)
            shape[dim] *= tp.size
            param.data = param.data.new_zeros(shape)
        yield
        loaded = True
    finally:
        for param, dim in split:
            if not loaded:
                param.data = shards[id(param)]
                continue
            whole = param.data
            param.data = whole.chunk(tp.size, dim=dim)[tp.rank].clone()
            state = _states(optimizer, param)
            for key, value in list(state.items()):
                if torch.is_tensor(value) and value.shape == whole.shape:
                    state[key] = value.chunk(tp.size, dim=dim)[tp.rank].clone()
