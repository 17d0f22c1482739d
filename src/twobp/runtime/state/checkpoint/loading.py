"""Reading a checkpoint: into a pipeline (collective, checked before anything changes), or
merged into one state dict in a single process.

See :mod:`twobp.runtime.state.checkpoint` for the layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import integrity
from twobp.runtime.state.checkpoint.entries import (
    MODEL,
    merge_optimizer_json,
    optimizer_state,
    optimizer_tensor_names,
    rng_state_from_entries,
    rng_tensor_names,
)
from twobp.runtime.state.checkpoint.saving import wait
from twobp.runtime.state.checkpoint.shards import (
    load_sharded_state,
    master_targets,
    sharded_names,
    sharded_targets,
)
from twobp.runtime.state.checkpoint.tensor_shards import local

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage
from twobp.runtime.state.optimizer_and_rng import (
    load_optimizer_state_by_name,
    parameter_names,
    set_rng_state,
)

if TYPE_CHECKING:  # the state calls this module
    from twobp.runtime.state.model_state import PipelineState

__all__ = ["load", "merge"]


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
    world = pipe.checkpoint_world
    problem: Exception | None = None
    plan: _LoadPlan | None = None
    try:
        plan = _plan(pipe, path, optimizer)
    except Exception as exc:  # any failure here must reach every rank
        problem = storage.checkpoint_error(exc, f"rank {world.rank} cannot load {path}")
    agree(world, pipe.device, pipe.timeout, problem, "loading a checkpoint")
    assert plan is not None
    problem = None
    try:
        storage.read(plan.tensors, plan.folder, world.group)
    except storage.FAILURES as exc:
        problem = storage.own_error(exc, world.rank, f"cannot load {plan.folder}")
    agree(world, pipe.device, pipe.timeout, problem, "loading a checkpoint")
    # A tensor-parallel rank's shards were read as DTensors: the shards themselves.
    plan.tensors, plan.shards = local(plan.tensors), local(plan.shards)
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


def _check_fits(
    rank: int,
    folder: Path,
    own: dict[str, list[int]],
    saved: dict[str, Any],
    saved_optimizer: str | None,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Refuse a checkpoint whose tensors or optimizer do not fit this rank's.

    Raises:
        CheckpointError: naming what is missing or of another shape, or the optimizer.
    """
    missing = [n for n in own if n not in saved]
    wrong = [
        f"{n} is {shape} here but {saved[n]['shape']} in the checkpoint"
        for n, shape in own.items()
        if n in saved and shape != saved[n]["shape"]
    ]
    if missing or wrong:
        problems = (
            f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
            if missing
            else ""
        ) + "; ".join(wrong[:5])
        raise CheckpointError(
            f"rank {rank}: {folder} does not fit this model ({problems}); load a "
            "checkpoint of the same model (any partition and number of ranks will do)"
        )
    if optimizer is not None and saved_optimizer is None:
        raise CheckpointError(
            f"{folder} was saved without an optimizer; load it with optimizer=None"
        )
    if optimizer is not None and saved_optimizer != type(optimizer).__name__:
        raise CheckpointError(
            f"{folder} holds the state of a {saved_optimizer}, not of a "
            f"{type(optimizer).__name__}; use the same optimizer class"
        )


def _plan(
    pipe: PipelineState, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None
) -> _LoadPlan:
    """Read and check what this rank needs to load, changing nothing."""
    # Every rank checks the sizes, and computes the CRC-32s of its share of the files.
    world = pipe.checkpoint_world
    manifest = integrity.check(path, share=(world.rank, world.size))
    folder = Path(manifest["path"])
    saved = manifest["tensors"]
    split = pipe.tensor_shards()
    own = {n: split.whole_shape(n, t.shape) for n, t in pipe.state_dict().items()}
    _check_fits(world.rank, folder, own, saved, manifest["optimizer"], optimizer)
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
    # Each rank's shard of what is split (DCP reads the saved chunks that cover it).
    tensors: dict[str, Any] = {n: split.target(n, *stored[n]) for n in wanted}
    shards = masters = None
    if sharded is not None and optimizer_json is not None:
        targets, shards = sharded_targets(sharded, optimizer_json, stored, by_id, split)
        tensors.update(targets)
        targets, masters = master_targets(sharded, stored, split)
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
