"""Checkpoints of a pipeline: ``torch.distributed.checkpoint`` tensors, a JSON manifest, atomic.

A folder of checkpoints holds one sub-folder per saved step::

    checkpoints/
      step-00000200/
        __0_0.distcp      tensors of pipeline rank 0, in torch.distributed.checkpoint (DCP)
        __1_0.distcp      format: weights and buffers, optimizer state, RNG states, by name
        .metadata         DCP's index of every tensor (written once all data is in place)
        manifest.json     written last: step, schedule, stages, optimizer groups, RNG
                          rest, every rank's extra, the loss scaler's state, each
                          file's size and CRC-32 (JSON)

The tensors are named as in the single-process model (``model.3.attn.q.weight``,
``optimizer.state.3.attn.q.weight.exp_avg``; see :mod:`.entries`),
so a checkpoint loads into another partition, schedule or number of ranks, and
``torch.distributed.checkpoint.load`` reads it without twobp. One replica of
each stage writes (:attr:`Topology.writes_stage_files`).

Every rank writes into ``.partial-step-00000200``; once all have, rank 0 writes
the manifest and renames the folder to ``step-00000200``. A crash at any
moment leaves the earlier checkpoints as they were: a folder without a manifest
is never loaded, and older checkpoints are deleted only after the new one is
complete. With ``async_save=True`` the tensors are copied at once and written
in the background; rank 0 completes the checkpoint when every rank's data is
written, and the next ``save``, ``load`` or :func:`wait` reports how it went.

Loading first checks the files against the manifest (sizes, and CRC-32s that
the ranks split between them; see :mod:`.integrity`): a damaged
checkpoint raises a :class:`CheckpointError` naming the file and the previous
intact checkpoint. Loading unpickles nothing from the checkpoint: tensors are read with
``weights_only``, DCP's metadata through an allow-list of its own classes, and
the rest is JSON. The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from twobp.runtime.communication import collective
from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import integrity
from twobp.runtime.state.checkpoint.background import BackgroundSaves
from twobp.runtime.state.checkpoint.entries import (
    MODEL,
    check_json,
    merge_optimizer_json,
    model_entries,
    optimizer_entries,
    optimizer_state,
    optimizer_tensor_names,
    rng_entries,
    rng_state_from_entries,
    rng_tensor_names,
)
from twobp.runtime.state.checkpoint.files import (
    FORMAT,
    VERSION,
    find_checkpoint,
    fresh_folder,
    is_checkpoint,
    latest_checkpoint,
    publish,
    read_manifest,
    step_folder,
)
from twobp.runtime.state.checkpoint.shards import (
    load_sharded_state,
    master_targets,
    sharded_entries,
    sharded_names,
    sharded_targets,
)

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage
from twobp.runtime.state.optimizer_and_rng import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    parameter_names,
    rng_state,
    set_rng_state,
)
from twobp.runtime.state.sharded_optimizer import ShardedParameters

if TYPE_CHECKING:  # the state calls this module
    from twobp.runtime.state.model_state import PipelineState

__all__ = [
    "BackgroundSaves",
    "find_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "load",
    "merge",
    "read_manifest",
    "save",
    "wait",
]


# -- writing ---------------------------------------------------------------------------


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
    world, device, timeout = pipe.topology.members, pipe.device, pipe.timeout
    problem: Exception | None = None
    if pipe.rank == 0:
        problem = _attempt(lambda: fresh_folder(partial), f"cannot create {partial}")
    agree(world, device, timeout, problem, "starting to save a checkpoint")
    tensors: dict[str, Any] = {}
    part: dict[str, Any] | None = None
    problem = None
    try:
        if not partial.is_dir():
            raise CheckpointError(
                f"rank {pipe.rank} does not see {partial}, which rank 0 created: the checkpoint "
                "folder must be on a file system that every rank shares"
            )
        # One copy per stage: the first replica of this rank's stages writes it; every
        # rank of a sharded optimizer writes its shards' part of the optimizer state.
        sharded = pipe.sharded_for(optimizer)
        if pipe.topology.writes_stage_files:
            tensors, part = _entries(pipe, optimizer, extra, sharded)
        elif sharded is not None and optimizer is not None:
            tensors, _ = _sharded_part(pipe, optimizer, sharded, set())
    except Exception as exc:  # any failure here must reach every rank
        problem = storage.checkpoint_error(exc, f"rank {pipe.rank} cannot save")
    agree(world, device, timeout, problem, "preparing a checkpoint")
    every = collective.all_gather_objects(world, (pipe.pp_rank, part))
    manifest = _manifest(pipe, step, every, optimizer, meta) if pipe.rank == 0 else {}
    if async_save:
        complete = (
            (lambda: _publish_recorded(partial, final, manifest, keep)) if pipe.rank == 0 else None
        )
        pipe.background_saves.start(world, timeout, tensors, partial, final, complete)
        return final
    problem = None
    files: dict[str, Any] = {}
    try:
        storage.write(tensors, partial, world.group)
        # Read back at once, from the page cache: each rank the files it wrote.
        files = integrity.record(
            partial, integrity.written_files(partial, tensors, coordinator=pipe.rank == 0)
        )
    except storage.FAILURES as exc:
        problem = storage.own_error(exc, pipe.rank, "cannot write its part of the checkpoint")
    agree(world, device, timeout, problem, "writing a checkpoint")
    for part_files in collective.all_gather_objects(world, files):
        manifest.setdefault("files", {}).update(part_files)
    problem = None
    if pipe.rank == 0:
        problem = _attempt(
            lambda: publish(partial, final, manifest, keep), f"cannot complete {final}"
        )
    agree(world, device, timeout, problem, "completing a checkpoint")
    return final


def _publish_recorded(partial: Path, final: Path, manifest: dict[str, Any], keep: int) -> None:
    """Record every file's size and CRC-32 (reading them back), then publish."""
    files = integrity.record(partial, integrity.all_files(partial))
    publish(partial, final, {**manifest, "files": files}, keep)


def _entries(
    pipe: PipelineState,
    optimizer: torch.optim.Optimizer | None,
    extra: Any,
    sharded: ShardedParameters | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's tensors, and its JSON part of the manifest."""
    # One copy of each tensor in the whole checkpoint: the blocks this rank writes.
    state = {n: t for n, t in pipe.state_dict().items() if pipe.writes(n)}
    tensors = model_entries(state)
    rng_tensors, rng_rest = rng_entries(pipe.pp_rank, rng_state(pipe.device))
    tensors.update(rng_tensors)
    part: dict[str, Any] = {
        "tensors": {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in state.items()
        },
        "extra": check_json(extra, "extra"),
        "rng": rng_rest,
        "optimizer": None,
    }
    if optimizer is not None and sharded is not None:
        optimizer_tensors, part["optimizer"] = _sharded_part(pipe, optimizer, sharded, set(state))
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
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sharded optimizer's tensors on this rank (its shards' part of every parameter's
    state), and the JSON part of the parameters in ``written`` (those this rank writes)."""
    named = list(pipe.named_parameters())
    names = parameter_names(named)
    shapes = {n: list(p.shape) for n, p in named}
    tensors, json_state = sharded_entries(sharded, optimizer, shapes, written, names)
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


# -- reading ---------------------------------------------------------------------------


@dataclass
class _LoadPlan:
    folder: Path
    tensors: dict[str, Any]
    """What DCP fills: every tensor (or boxes of one) this rank needs, by checkpoint name."""
    own: list[str]
    """This rank's state-dict names."""
    optimizer: dict[str, Any] | None
    """The optimizer's JSON part (every rank's groups, this rank's state)."""
    rng: dict[str, Any] | None
    """The JSON rest of the RNG states to restore (None: keep this process's)."""
    home: int
    extra: Any
    step: int
    shards: dict[int, dict[str, Any]] | None = None
    """A sharded optimizer's state by the index of its parameters, filled by DCP."""
    masters: dict[int, Tensor] | None = None
    """A sharded optimizer's float32 master shards by shard index, filled by DCP."""
    grad_scaler: dict[str, Any] | None = None
    """The loss scaler's state (None: saved without one, or from a disabled one)."""


def load(
    pipe: PipelineState,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Load a checkpoint into ``pipe`` (and ``optimizer``); returns the saved extra.

    Collective: every rank calls it. Every rank first reads and checks what it
    needs (and its share of the files' CRC-32s); only when all ranks succeeded
    does any rank change its state. See :meth:`Pipeline.load`.

    Raises:
        CheckpointError: on every rank, if any rank cannot load, or a file of
            the checkpoint is missing, truncated or changed since it was saved.
    """
    wait(pipe)
    world = pipe.topology.members
    problem: Exception | None = None
    plan: _LoadPlan | None = None
    try:
        plan = _plan(pipe, path, optimizer)
    except Exception as exc:  # any failure here must reach every rank
        problem = storage.checkpoint_error(exc, f"rank {pipe.rank} cannot load {path}")
    agree(world, pipe.device, pipe.timeout, problem, "loading a checkpoint")
    assert plan is not None
    problem = None
    try:
        storage.read(plan.tensors, plan.folder, world.group)
    except storage.FAILURES as exc:
        problem = storage.own_error(exc, pipe.rank, f"cannot load {plan.folder}")
    agree(world, pipe.device, pipe.timeout, problem, "loading a checkpoint")
    pipe.load_state_dict({n: plan.tensors[MODEL + n] for n in plan.own}, strict=True)
    if optimizer is not None and plan.optimizer is not None and plan.shards is not None:
        sharded = pipe.sharded_for(optimizer)
        assert sharded is not None
        groups = optimizer_state(plan.optimizer, {}, [])["param_groups"]
        order = sharded_names(sharded, parameter_names(pipe.named_parameters()))
        load_sharded_state(optimizer, plan.shards, groups, order[0] if order else None)
        # The float32 masters saved with it, rather than the loaded parameters rounded.
        sharded.load_masters(plan.masters or {})
    elif optimizer is not None and plan.optimizer is not None:
        names = parameter_names(pipe.named_parameters())
        saved = optimizer_state(plan.optimizer, plan.tensors, list(names.values()))
        load_optimizer_state_by_name(optimizer, names, [saved])
    if plan.rng is not None:
        set_rng_state(rng_state_from_entries(plan.home, plan.tensors, plan.rng), pipe.device)
    if pipe.grad_scaler is not None and plan.grad_scaler:
        pipe.grad_scaler.load_state_dict(plan.grad_scaler)
    pipe.step_count = plan.step
    return plan.extra


def _plan(
    pipe: PipelineState, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None
) -> _LoadPlan:
    """Read and check what this rank needs to load, changing nothing."""
    # Every rank checks the sizes, and computes the CRC-32s of its share of the files.
    world = pipe.topology.members
    manifest = integrity.check(path, share=(world.rank, world.size))
    folder = Path(manifest["path"])
    saved = manifest["tensors"]
    own = pipe.state_dict()
    missing = [n for n in own if n not in saved]
    wrong = [
        f"{n} is {list(t.shape)} here but {saved[n]['shape']} in the checkpoint"
        for n, t in own.items()
        if n in saved and list(t.shape) != saved[n]["shape"]
    ]
    if missing or wrong:
        problems = (
            f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
            if missing
            else ""
        ) + "; ".join(wrong[:5])
        raise CheckpointError(
            f"rank {pipe.rank}: {folder} does not fit this model ({problems}); load a "
            "checkpoint of the same model (any partition and number of ranks will do)"
        )
    if optimizer is not None and manifest["optimizer"] is None:
        raise CheckpointError(
            f"{folder} was saved without an optimizer; load it with optimizer=None"
        )
    if optimizer is not None and manifest["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(
            f"{folder} holds the state of a {manifest['optimizer']}, not of a "
            f"{type(optimizer).__name__}; use the same optimizer class"
        )
    stored = storage.tensor_shapes(folder)
    wanted = [MODEL + n for n in own]
    optimizer_json = None
    sharded = pipe.sharded_for(optimizer)
    if optimizer is not None:
        optimizer_json = merge_optimizer_json(
            [r["optimizer"] for r in manifest["ranks"] if r["optimizer"] is not None]
        )
        by_id = parameter_names(pipe.named_parameters())
        names = sharded_names(sharded, by_id) if sharded is not None else list(by_id.values())
        needed = optimizer_tensor_names(optimizer_json, names)
        if sharded is None:
            wanted += needed
        elif any(n not in stored for n in needed):
            absent = [n for n in needed if n not in stored]
            raise CheckpointError(
                f"{folder} is incomplete: its DCP metadata has no {', '.join(absent[:3])}"
            )
    same_world = manifest["world_size"] == pipe.topology.pp_size
    home = pipe.pp_rank if same_world else 0
    # Another number of ranks: the RNG streams no longer match ranks, keep this process's.
    rng = manifest["ranks"][home]["rng"] if same_world else None
    if rng is not None:
        cuda = pipe.device.type == "cuda" and f"rng.{home}.cuda" in stored
        wanted += rng_tensor_names(home, rng, cuda)
    absent = [n for n in wanted if n not in stored]
    if absent:
        raise CheckpointError(
            f"{folder} is incomplete: its DCP metadata has no {', '.join(absent[:3])}"
        )
    tensors: dict[str, Any] = {n: torch.empty(stored[n][0], dtype=stored[n][1]) for n in wanted}
    shards = masters = None
    if sharded is not None and optimizer_json is not None:
        targets, shards = sharded_targets(sharded, optimizer_json, stored, by_id)
        tensors.update(targets)
        targets, masters = master_targets(sharded, stored)
        tensors.update(targets)
    return _LoadPlan(
        folder=folder,
        tensors=tensors,
        shards=shards,
        masters=masters,
        own=list(own),
        optimizer=optimizer_json,
        rng=rng,
        home=home,
        extra=manifest["ranks"][home]["extra"],
        step=int(manifest["step"]),
        grad_scaler=manifest.get("grad_scaler"),
    )


def merge(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The single-process state dict of a checkpoint (what ``nn.Sequential(*blocks)`` loads).

    Reads in this process alone (not collective).

    Args:
        path: a checkpoint, or a folder of checkpoints (its latest is used).

    Returns:
        Every parameter and buffer, named as in ``nn.Sequential(*blocks)``, in block
        order (or as in the model that ``twobp.split`` cut); a weight tied across
        stages under each of its names, as ``state_dict()`` of the model gives it.

    Raises:
        CheckpointError: if there is no complete checkpoint, it is damaged (a
            file missing, truncated or changed since it was saved: the message
            names it), or it cannot be read.
    """
    manifest = integrity.check(path)
    folder = Path(manifest["path"])
    tensors = {
        MODEL + name: torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        for name, entry in manifest["tensors"].items()
    }
    try:
        storage.read(tensors, folder, None)
    except storage.FAILURES as exc:
        own = storage.own_failure(exc, 0) or RuntimeError(str(exc))
        raise storage.checkpoint_error(own, f"cannot read {folder}") from None
    state = {name: tensors[MODEL + name] for name in manifest["tensors"]}
    for alias, name in manifest.get("aliases", {}).items():
        if name in state:
            state.setdefault(alias, state[name])
    return state
