"""Writing a checkpoint: every rank's tensors, then rank 0's manifest, published atomically.

See :mod:`twobp.runtime.state.checkpoint` for the layout. With ``async_save=True``
the tensors are written in the background (:mod:`.background`) and :func:`wait`
reports how it went.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from twobp.runtime.communication import collective
from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import integrity
from twobp.runtime.state.checkpoint.entries import (
    check_json,
    model_entries,
    optimizer_entries,
    rng_entries,
)
from twobp.runtime.state.checkpoint.files import FORMAT, VERSION, fresh_folder, publish, step_folder
from twobp.runtime.state.checkpoint.shards import sharded_entries, sharded_names
from twobp.runtime.state.checkpoint.tensor_shards import TensorShards

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage
from twobp.runtime.state.optimizer_and_rng import (
    optimizer_state_by_name,
    parameter_names,
    rng_state,
)
from twobp.runtime.state.sharded_optimizer import ShardedParameters

if TYPE_CHECKING:  # the state calls this module
    from twobp.runtime.state.model_state import PipelineState

__all__ = ["save", "wait"]


def save(
    pipe: PipelineState,
    root: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    keep: int = 1,
    async_save: bool = False,
) -> Path:
    """Write a checkpoint of ``pipe`` into the folder of checkpoints ``root``.

    Collective: every rank calls it. See :meth:`Pipeline.save`.

    Returns:
        The checkpoint's folder (complete once :func:`wait` returns, if ``async_save``).

    Raises:
        CheckpointError: on every rank, if any rank cannot write.
    """
    if keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least the checkpoint being written")
    wait(pipe)
    step = pipe.step_count if step is None else step
    final = Path(root) / step_folder(step)
    partial = final.with_name(f".partial-{final.name}")
    world, device, timeout = pipe.checkpoint_world, pipe.device, pipe.timeout
    coordinator = world.rank == 0
    problem: Exception | None = None
    if coordinator:
        problem = _attempt(lambda: fresh_folder(partial), f"cannot create {partial}")
    agree(world, device, timeout, problem, "starting to save a checkpoint")
    tensors: dict[str, Any] = {}
    part: dict[str, Any] | None = None
    problem = None
    try:
        if not partial.is_dir():
            raise CheckpointError(
                f"rank {world.rank} does not see {partial}, which rank 0 created: the "
                "checkpoint folder must be on a file system that every rank shares"
            )
        tensors, part = _written(pipe, optimizer, extra)
    except Exception as exc:  # any failure here must reach every rank
        problem = storage.checkpoint_error(exc, f"rank {world.rank} cannot save")
    agree(world, device, timeout, problem, "preparing a checkpoint")
    every = collective.all_gather_objects(world, (pipe.pp_rank, part))
    manifest = _manifest(pipe, step, every, optimizer, meta) if coordinator else {}
    if async_save:
        complete = (
            (lambda: _publish_recorded(partial, final, manifest, keep)) if coordinator else None
        )
        pipe.background_saves.start(world, timeout, tensors, partial, final, complete)
        return final
    problem = None
    files: dict[str, Any] = {}
    try:
        storage.write(tensors, partial, world.group)
        # Read back at once, from the page cache: each rank the files it wrote.
        files = integrity.record(
            partial, integrity.written_files(partial, tensors, coordinator=coordinator)
        )
    except storage.FAILURES as exc:
        problem = storage.own_error(exc, world.rank, "cannot write its part of the checkpoint")
    agree(world, device, timeout, problem, "writing a checkpoint")
    for part_files in collective.all_gather_objects(world, files):
        manifest.setdefault("files", {}).update(part_files)
    problem = None
    if coordinator:
        problem = _attempt(
            lambda: publish(partial, final, manifest, keep), f"cannot complete {final}"
        )
    agree(world, device, timeout, problem, "completing a checkpoint")
    return final


def _written(
    pipe: PipelineState, optimizer: torch.optim.Optimizer | None, extra: Any
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The tensors this rank writes, and its JSON part of the manifest (None: it has none)."""
    # One copy per stage: the first replica of this rank's stages writes it; every
    # rank of a sharded optimizer writes its shards' part of the optimizer state;
    # every tensor-parallel rank its shards, rank 0 of each group the rest.
    sharded = pipe.sharded_for(optimizer)
    split = pipe.tensor_shards()
    tensors: dict[str, Any] = {}
    part: dict[str, Any] | None = None
    if pipe.topology.writes_stage_files:
        tensors, part = _entries(pipe, optimizer, extra, sharded, split)
    elif sharded is not None and optimizer is not None:
        tensors, _ = _sharded_part(pipe, optimizer, sharded, set(), split)
    return split.saved(tensors), part if split.writes_replicated else None


def _publish_recorded(partial: Path, final: Path, manifest: dict[str, Any], keep: int) -> None:
    """Record every file's size and CRC-32 (reading them back), then publish."""
    files = integrity.record(partial, integrity.all_files(partial))
    publish(partial, final, {**manifest, "files": files}, keep)


def _entries(
    pipe: PipelineState,
    optimizer: torch.optim.Optimizer | None,
    extra: Any,
    sharded: ShardedParameters | None,
    split: TensorShards,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's tensors (its shards as they are: :meth:`TensorShards.saved` picks those
    it writes), and its JSON part of the manifest (whole shapes)."""
    # One copy of each tensor in the whole checkpoint: the blocks this rank writes.
    state = {n: t for n, t in pipe.state_dict().items() if pipe.writes(n)}
    tensors = model_entries(state)
    rng_tensors, rng_rest = rng_entries(pipe.pp_rank, rng_state(pipe.device))
    tensors.update(rng_tensors)
    part: dict[str, Any] = {
        "tensors": {
            name: {
                "shape": split.whole_shape(name, t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
            }
            for name, t in state.items()
        },
        "extra": check_json(extra, "extra"),
        "rng": rng_rest,
        "optimizer": None,
    }
    if optimizer is not None and sharded is not None:
        optimizer_tensors, part["optimizer"] = _sharded_part(
            pipe, optimizer, sharded, set(state), split
        )
        tensors.update(optimizer_tensors)
    elif optimizer is not None:
        by_name = optimizer_state_by_name(optimizer, parameter_names(pipe.named_parameters()))
        by_name["state"] = {n: v for n, v in by_name["state"].items() if n in state}
        optimizer_tensors, part["optimizer"] = optimizer_entries(by_name)
        tensors.update(optimizer_tensors)
    return tensors, part


def _sharded_part(
    pipe: PipelineState,
    optimizer: torch.optim.Optimizer,
    sharded: ShardedParameters,
    written: set[str],
    split: TensorShards,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sharded optimizer's tensors on this rank (its shards' part of every parameter's
    state), and the JSON part of the parameters in ``written`` (those this rank writes)."""
    named = list(pipe.named_parameters())
    names = parameter_names(named)
    shapes = {n: list(p.shape) for n, p in named}
    tensors, json_state = sharded_entries(sharded, optimizer, shapes, written, names, split)
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    ordered = [n for n in sharded_names(sharded, names) if n in written]
    _, part = optimizer_entries({"state": {}, "param_groups": [{**hyper, "params": ordered}]})
    part["state"] = json_state
    return tensors, part


def _manifest(
    pipe: PipelineState,
    step: int,
    every: list[tuple[int, dict[str, Any] | None]],
    optimizer: torch.optim.Optimizer | None,
    meta: Mapping[str, Any] | None,
) -> dict[str, Any]:
    parts = {pp_rank: part for pp_rank, part in every if part is not None}
    tensors = {
        name: {**entry, "rank": pp_rank}
        for pp_rank, part in sorted(parts.items())
        for name, entry in part["tensors"].items()
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "storage": "torch.distributed.checkpoint",
        "step": step,
        "world_size": pipe.topology.pp_size,
        "tensor_parallel": pipe.tensor_shards().size,
        "schedule": pipe.schedule.name,
        "n_microbatches": pipe.n_microbatches,
        "placement": list(pipe.schedule.placement),
        "stage_blocks": [[r.start, r.stop] for r in pipe.stage_blocks],
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "tensors": dict(sorted(tensors.items(), key=lambda item: block_order(item[0]))),
        "aliases": pipe.state_aliases(),
        "ranks": [
            {key: parts[r][key] for key in ("extra", "rng", "optimizer")}
            for r in range(pipe.topology.pp_size)
        ],
        # The same on every rank (the ranks agree on every update).
        "grad_scaler": pipe.grad_scaler.state_dict() if pipe.grad_scaler is not None else None,
        "meta": dict(meta or {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def block_order(name: str) -> int:
    # Sorting is stable: the entries of a block keep their state-dict order.
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def wait(pipe: PipelineState) -> Path | None:
    """Wait until the checkpoint written in the background is complete. Collective.

    Returns:
        The checkpoint's folder, or None if none was being written.

    Raises:
        CheckpointError: on every rank, if any rank could not write its part.
    """
    pending = pipe.background_saves.pending
    if pending is None:
        return None
    pipe.background_saves.pending = None
    problem = pending.outcome(pipe.rank)
    where = "completing a checkpoint written in the background"
    agree(pipe.topology.members, pipe.device, pipe.timeout, problem, where)
    return pending.final


def _attempt(action: Any, what: str) -> Exception | None:
    try:
        action()
    except Exception as exc:  # any failure here must reach every rank
        return storage.checkpoint_error(exc, what)
    return None
