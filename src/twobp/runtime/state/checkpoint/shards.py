"""A sharded optimizer's state in a checkpoint: each rank writes and reads its part by name.

A rank of a sharded optimizer (:mod:`.sharded_optimizer`) holds, for each
parameter in its shards, a contiguous range of the flattened parameter's
state. In the checkpoint the state is stored as the unsharded optimizer
stores it (``optimizer.state.<name>.exp_avg``, the parameter's shape), and
each holder writes its range as boxes of that tensor (DCP chunks, see
:func:`flat_boxes`); DCP's metadata lists the chunks of every tensor. So a
sharded checkpoint loads into an unsharded optimizer (DCP puts the chunks
together), an unsharded one into a sharded optimizer (each rank reads the
boxes of its ranges), and either onto any number of copies and ranks.

A 0-dim value of the state (AdamW's ``step``), the same for every element of
a shard, is written once per parameter, by the rank whose shard holds the
parameter's first element.

With tensor parallelism a rank's ranges are of its shard of a split
parameter: their boxes move to where the shard sits in the whole tensor
(:meth:`.tensor_shards.TensorShards.pieces`), so the state loads at any
tensor-parallel size too.

The float32 master shards of half-precision parameters are written the same
way, as ``optimizer.master.<name>`` (float32, the parameter's shape): a
sharded optimizer that loads the checkpoint resumes from them (on any layout),
one whose checkpoint has none (an unsharded or float32 one) starts its masters
from the loaded parameters, and an unsharded optimizer ignores them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint.entries import MASTER, OPTIMIZER_STATE, check_json
from twobp.runtime.state.checkpoint.tensor_shards import TensorShards

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.sharded_optimizer import ShardedParameters

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""A box of a tensor: its offsets, its sizes, and where it starts in the flat range."""


def flat_boxes(shape: Sequence[int], first: int, stop: int) -> list[Box]:
    """Elements ``first:stop`` of a tensor of ``shape``, flattened, as boxes of the tensor.

    Each box is a contiguous run of the flattened tensor: at most two per
    dimension, fewer when the range starts and ends on a row.

    >>> flat_boxes((2, 3), 1, 5)
    [((0, 1), (1, 2), 0), ((1, 0), (1, 2), 2)]
    """
    shape = tuple(int(n) for n in shape)
    if not shape:
        return [((), (), 0)] if first < stop else []
    out: list[Box] = []
    _boxes(shape, first, stop, (), 0, out)
    return out


def _boxes(
    shape: tuple[int, ...], first: int, stop: int, prefix: tuple[int, ...], at: int, out: list[Box]
) -> None:
    """Boxes of ``first:stop`` of the sub-tensor of ``shape`` at index ``prefix``."""
    if first >= stop:
        return
    inner = math.prod(shape[1:])
    rest = shape[1:]
    head, tail = divmod(first, inner)
    if tail:  # a partial first row
        end = min(stop, (head + 1) * inner)
        _boxes(rest, tail, end - head * inner, (*prefix, head), at, out)
        _boxes(shape, end, stop, prefix, at + end - first, out)
        return
    rows = (stop - first) // inner
    if rows:
        offsets = (*prefix, head) + (0,) * len(rest)
        out.append((offsets, (1,) * len(prefix) + (rows, *rest), at))
    done = first + rows * inner
    if done < stop:
        _boxes(rest, 0, stop - done, (*prefix, head + rows), at + done - first, out)


def _piece_boxes(shape: Sequence[int], first: int, stop: int, flat: Tensor) -> list[Any]:
    """The boxes of ``first:stop`` of a tensor of ``shape``, as views of ``flat`` (the range)."""
    return [
        (offsets, flat[at : at + math.prod(sizes)].view(sizes))
        for offsets, sizes, at in flat_boxes(shape, first, stop)
    ]


# -- saving ------------------------------------------------------------------------------


def sharded_entries(
    sharded: ShardedParameters,
    optimizer: torch.optim.Optimizer,
    shapes: Mapping[str, Sequence[int]],
    writes_json: set[str],
    whole_names: Mapping[int, str],
    split: TensorShards,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's part of a sharded optimizer's state, by name.

    Args:
        sharded: the shards.
        optimizer: the optimizer over them.
        shapes: the shape of every parameter of this rank, by name.
        writes_json: the names whose JSON entries this rank writes (one copy).
        whole_names: ``id(parameter) -> name`` of the parameters stepped whole.
        split: where this rank's tensor-parallel shards sit in the whole tensors.

    Returns:
        The tensors (:class:`~.storage.Pieces` and whole tensors) by checkpoint name, and
        the JSON part as :func:`.entries.optimizer_entries` makes it.

    Raises:
        CheckpointError: if a value of the state is neither a tensor nor JSON data.
    """
    tensors: dict[str, Any] = {}
    json_state: dict[str, Any] = {}
    state = optimizer.state
    for shard in sharded.shards:
        # Every holder has stepped its shard alike: the same keys, the same values.
        entries = state.get(shard.master, {})
        keys = [k for k, v in entries.items() if isinstance(v, Tensor)]
        values = {
            k: check_json(v, f"the optimizer state {k!r} of {shard.bucket.key}")
            for k, v in entries.items()
            if not isinstance(v, Tensor)
        }
        for name in shard.names:
            if name in writes_json:
                json_state[name] = {"tensors": keys, "values": values}
    for shard, name, first, stop, at in sharded.pieces():
        for key, value in state.get(shard.master, {}).items():
            if not isinstance(value, Tensor):
                continue
            if value.numel() == shard.master.numel() and value.dim():
                part = value.detach()[at : at + stop - first].clone()
                tensors[f"{OPTIMIZER_STATE}{name}.{key}"] = split.pieces(
                    name, shapes[name], _piece_boxes(shapes[name], first, stop, part)
                )
            elif first == 0:
                tensors[f"{OPTIMIZER_STATE}{name}.{key}"] = value.detach().clone()
    for shard, name, first, stop, at in sharded.pieces():
        if shard.copies_master:
            part = shard.master.detach()[at : at + stop - first].clone()
            tensors[f"{MASTER}{name}"] = split.pieces(
                name, shapes[name], _piece_boxes(shapes[name], first, stop, part)
            )
    for p in sharded.whole:
        name = whole_names[id(p)]
        keys, values = [], {}
        for key, value in state.get(p, {}).items():
            if isinstance(value, Tensor):
                tensors[f"{OPTIMIZER_STATE}{name}.{key}"] = value
                keys.append(key)
            else:
                values[key] = check_json(value, f"the optimizer state {key!r} of {name}")
        if name in writes_json:
            json_state[name] = {"tensors": keys, "values": values}
    return tensors, json_state


def sharded_names(sharded: ShardedParameters, whole_names: Mapping[int, str]) -> list[str]:
    """Every parameter name the sharded optimizer steps, in its order."""
    names = list(dict.fromkeys(n for s in sharded.shards for n in s.names))
    return names + [whole_names[id(p)] for p in sharded.whole]


# -- loading ------------------------------------------------------------------------------


def sharded_targets(
    sharded: ShardedParameters,
    saved: Mapping[str, Any],
    stored: Mapping[str, tuple[list[int], torch.dtype]],
    whole_names: Mapping[int, str],
    split: TensorShards,
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """What DCP fills to load this rank's shards of a saved optimizer state.

    Args:
        sharded: the shards.
        saved: the checkpoint's merged JSON optimizer part.
        stored: every tensor of the checkpoint, its shape and dtype.
        whole_names: ``id(parameter) -> name`` of the parameters stepped whole.
        split: where this rank's tensor-parallel shards sit in the whole tensors.

    Returns:
        The targets by checkpoint name, and the state of each optimizer
        parameter (by its index in the optimizer) that they fill.

    Raises:
        CheckpointError: if the checkpoint lacks the state of a parameter here
            while holding that of others of its shard.
    """
    targets: dict[str, Any] = {}
    boxes: dict[str, list[Any]] = {}
    states: dict[int, dict[str, Any]] = {}
    state = saved["state"]
    for index, shard in enumerate(sharded.shards):
        pieces = [(n, f, s, at) for sh, n, f, s, at in sharded.pieces() if sh is shard]
        held = [n for n, *_ in pieces if n in state]
        if not held:
            continue
        if len(held) != len(pieces):
            missing = [n for n, *_ in pieces if n not in state]
            raise CheckpointError(
                f"the checkpoint has optimizer state for {held[0]} but not for {missing[0]}, "
                "which this rank steps in one shard with it"
            )
        entry = state[held[0]]
        out: dict[str, Any] = dict(entry["values"])
        for key in entry["tensors"]:
            shape, dtype = stored[f"{OPTIMIZER_STATE}{held[0]}.{key}"]
            if not shape:  # one value for the whole shard
                name = f"{OPTIMIZER_STATE}{held[0]}.{key}"
                out[key] = targets.setdefault(name, torch.empty((), dtype=dtype))
                continue
            flat = torch.zeros(shard.layout.size, dtype=dtype)
            out[key] = flat
            for name, first, stop, at in pieces:
                full = stored[f"{OPTIMIZER_STATE}{name}.{key}"][0]
                part = flat[at : at + stop - first]
                shape = split.local_shape(name, full)
                boxes.setdefault(f"{OPTIMIZER_STATE}{name}.{key}", []).extend(
                    _piece_boxes(shape, first, stop, part)
                )
                targets[f"{OPTIMIZER_STATE}{name}.{key}"] = (name, shape)
        states[index] = out
    for entry, found in boxes.items():
        name, shape = targets[entry]
        targets[entry] = split.pieces(name, shape, found)
    offset = len(sharded.shards)
    for i, p in enumerate(sharded.whole):
        name = whole_names[id(p)]
        if name not in state:
            continue
        out = dict(state[name]["values"])
        for key in state[name]["tensors"]:
            shape, dtype = stored[f"{OPTIMIZER_STATE}{name}.{key}"]
            entry = f"{OPTIMIZER_STATE}{name}.{key}"
            out[key] = targets.setdefault(entry, split.target(entry, shape, dtype))
        states[offset + i] = out
    return targets, states


def master_targets(
    sharded: ShardedParameters,
    stored: Mapping[str, tuple[list[int], torch.dtype]],
    split: TensorShards,
) -> tuple[dict[str, Any], dict[int, Tensor]]:
    """What DCP fills to load the float32 master shards a checkpoint holds.

    Returns:
        The targets by checkpoint name, and the master of each shard (by its
        index) that they fill: only the shards of half-precision parameters
        whose every piece the checkpoint holds.
    """
    targets: dict[str, Any] = {}
    masters: dict[int, Tensor] = {}
    for index, shard in enumerate(sharded.shards):
        pieces = [(n, f, s, at) for sh, n, f, s, at in sharded.pieces() if sh is shard]
        if not shard.copies_master or any(f"{MASTER}{n}" not in stored for n, *_ in pieces):
            continue
        flat = torch.zeros(shard.layout.size, dtype=torch.float32)
        for name, first, stop, at in pieces:
            shape = split.local_shape(name, stored[f"{MASTER}{name}"][0])
            part = flat[at : at + stop - first]
            # The part of a parameter in one shard: one piece of it here.
            targets[f"{MASTER}{name}"] = split.pieces(
                name, shape, _piece_boxes(shape, first, stop, part)
            )
        masters[index] = flat
    return targets, masters


def load_sharded_state(
    optimizer: torch.optim.Optimizer,
    states: Mapping[int, dict[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    first_name: str | None,
) -> None:
    """Load the filled states into the sharded optimizer, with the hyper-parameters of
    the saved group that held ``first_name``."""
    hyper = next((g for g in groups if first_name in g["params"]), None)
    current = optimizer.state_dict()
    group = current["param_groups"][0]
    if hyper is not None:
        group = {**{k: v for k, v in hyper.items() if k != "params"}, "params": group["params"]}
    optimizer.load_state_dict({"state": dict(states), "param_groups": [group]})
