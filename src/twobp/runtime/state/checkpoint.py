"""Checkpoints of a pipeline: one file per rank, a manifest, atomic on disk.

A folder of checkpoints holds one sub-folder per saved step::

    checkpoints/
      step-00000200/
        rank-00000.pt     weights and buffers (single-process names), optimizer
        rank-00001.pt     state by name, RNG states, step, the caller's extra
        manifest.json     written last: world size, schedule, stages, names -> shapes

Every rank writes its file into ``.partial-step-00000200`` (a temporary file,
fsync, rename); once all ranks have, rank 0 writes the manifest and renames the
folder to ``step-00000200``. A crash at any moment leaves the earlier
checkpoints as they were: a folder without a manifest is never loaded, and
older checkpoints are deleted only after the new one is complete.

Because tensors are named as in ``nn.Sequential(*blocks)``, a checkpoint loads
into another partition, schedule or number of ranks, and :func:`merge` turns
it into a single-process state dict. The folder must be on a file system that
every rank sees.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from twobp.runtime.communication import collective
from twobp.runtime.errors import CheckpointError
from twobp.runtime.setup.agreement import agree
from twobp.runtime.setup.topology import Topology
from twobp.runtime.state.checkpoint_files import (
    FORMAT,
    VERSION,
    find_checkpoint,
    fresh_folder,
    is_checkpoint,
    latest_checkpoint,
    merge,
    publish,
    rank_file,
    read_manifest,
    step_folder,
    write_atomic,
)
from twobp.runtime.state.optimizer_and_rng import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    parameter_names,
    rng_state,
    set_rng_state,
)
from twobp.schedule.schedule import Schedule

__all__ = [
    "find_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "load",
    "merge",
    "read_manifest",
    "save",
]

class Checkpointable(Protocol):
    """What a checkpoint reads from and writes into a pipeline (its model state)."""

    rank: int
    pp_rank: int
    topology: Topology
    device: torch.device
    timeout: float
    step_count: int
    schedule: Schedule
    n_microbatches: int
    stage_blocks: tuple[range, ...]
    module: nn.Sequential

    def state_dict(self) -> dict[str, Any]: ...

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]: ...



# -- writing ---------------------------------------------------------------------------


def save(
    pipe: Checkpointable,
    root: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: Any = None,
    *,
    step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    keep: int = 1,
) -> Path:
    """Write a checkpoint of ``pipe`` into the folder of checkpoints ``root``.

    Collective: every rank calls it. See :meth:`Pipeline.save`.

    Returns:
        The checkpoint's folder.

    Raises:
        CheckpointError: on every rank, if any rank cannot write.
    """
    if keep < 1:
        raise CheckpointError(f"keep={keep}: keep at least the checkpoint being written")
    step = pipe.step_count if step is None else step
    folder = Path(root)
    final = folder / step_folder(step)
    partial = folder / f".partial-{final.name}"
    world, device, timeout = pipe.topology.members, pipe.device, pipe.timeout
    # One file per pipeline rank, written by the first replica of its stages.
    writes = pipe.topology.writes_stage_files
    problem: Exception | None = None
    if pipe.rank == 0:
        problem = _attempt(lambda: fresh_folder(partial), f"cannot create {partial}")
    agree(world, device, timeout, problem, "starting to save a checkpoint")
    payload = {
        "format": VERSION,
        "rank": pipe.pp_rank,
        "step": step,
        "model": pipe.state_dict(),
        "optimizer": None,
        "rng": rng_state(device),
        "extra": extra,
    }
    problem = None
    try:
        if optimizer is not None:
            payload["optimizer"] = optimizer_state_by_name(
                optimizer, parameter_names(pipe.named_parameters())
            )
        if not partial.is_dir():
            raise CheckpointError(
                f"rank {pipe.rank} does not see {partial}, which rank 0 created: the checkpoint "
                "folder must be on a file system that every rank shares"
            )
        if writes:
            write_atomic(partial / rank_file(pipe.pp_rank), lambda f: torch.save(payload, f))
    except Exception as exc:  # any failure here must reach every rank
        problem = _as_checkpoint_error(exc, f"rank {pipe.rank} cannot write its checkpoint file")
    agree(world, device, timeout, problem, "writing a checkpoint")
    described = {
        n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in payload["model"].items()
    }
    every = collective.all_gather_objects(world, (pipe.pp_rank, writes, described))
    problem = None
    if pipe.rank == 0:
        manifest = _manifest(pipe, step, every, optimizer, meta)
        problem = _attempt(
            lambda: publish(partial, final, manifest, keep), f"cannot complete {final}"
        )
    agree(world, device, timeout, problem, "completing a checkpoint")
    return final


def _manifest(
    pipe: Checkpointable,
    step: int,
    every: list[tuple[int, bool, dict[str, tuple[list[int], str]]]],
    optimizer: torch.optim.Optimizer | None,
    meta: Mapping[str, Any] | None,
) -> dict[str, Any]:
    tensors = {
        name: {"shape": shape, "dtype": dtype, "file": pp_rank}
        for pp_rank, writes, described in every
        if writes
        for name, (shape, dtype) in described.items()
    }
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": pipe.topology.pp_size,
        "schedule": pipe.schedule.name,
        "n_microbatches": pipe.n_microbatches,
        "placement": list(pipe.schedule.placement),
        "stage_blocks": [[r.start, r.stop] for r in pipe.stage_blocks],
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "files": [rank_file(r) for r in range(pipe.topology.pp_size)],
        "tensors": dict(sorted(tensors.items(), key=lambda item: block_order(item[0]))),
        "meta": dict(meta or {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def block_order(name: str) -> int:
    # Sorting is stable: the entries of a block keep their state-dict order.
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def _attempt(action: Any, what: str) -> Exception | None:
    try:
        action()
    except Exception as exc:  # any failure here must reach every rank
        return _as_checkpoint_error(exc, what)
    return None


def _as_checkpoint_error(exc: Exception, what: str) -> CheckpointError:
    if isinstance(exc, CheckpointError):
        return exc
    error = CheckpointError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


# -- reading ---------------------------------------------------------------------------


def load(
    pipe: Checkpointable,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Load a checkpoint into ``pipe`` (and ``optimizer``); returns the saved extra.

    Collective: every rank calls it. Every rank first reads and checks what it
    needs; only when all ranks succeeded does any rank change its state.
    See :meth:`Pipeline.load`.

    Raises:
        CheckpointError: on every rank, if any rank cannot load.
    """
    problem: Exception | None = None
    plan: _LoadPlan | None = None
    try:
        plan = _read(pipe, path, optimizer)
    except Exception as exc:  # any failure here must reach every rank
        problem = _as_checkpoint_error(exc, f"rank {pipe.rank} cannot load {path}")
    agree(pipe.topology.members, pipe.device, pipe.timeout, problem, "loading a checkpoint")
    assert plan is not None
    pipe.module.load_state_dict(plan.model, strict=True)
    if optimizer is not None:
        load_optimizer_state_by_name(
            optimizer, parameter_names(pipe.named_parameters()), plan.optimizer
        )
    if plan.rng is not None:
        set_rng_state(plan.rng, pipe.device)
    pipe.step_count = plan.step
    return plan.extra


class _LoadPlan:
    def __init__(
        self, model: dict[str, Tensor], optimizer: list[Any], rng: Any, extra: Any, step: int
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.rng = rng
        self.extra = extra
        self.step = step


def _read(
    pipe: Checkpointable, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None
) -> _LoadPlan:
    """Read and check everything this rank needs, changing nothing."""
    manifest = read_manifest(path)
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
    same_world = manifest["world_size"] == pipe.topology.pp_size
    home = pipe.pp_rank if same_world else 0
    needed = sorted({saved[n]["file"] for n in own} | {home})
    files = {
        r: torch.load(
            folder / manifest["files"][r], map_location="cpu", mmap=True, weights_only=False
        )
        for r in needed
    }
    model = {n: files[saved[n]["file"]]["model"][n] for n in own}
    optimizer_parts = [files[r]["optimizer"] for r in needed if files[r]["optimizer"] is not None]
    return _LoadPlan(
        model=model,
        optimizer=optimizer_parts,
        # Another number of ranks: the RNG streams no longer match ranks, keep this process's.
        rng=files[home]["rng"] if same_world else None,
        extra=files[home]["extra"],
        step=int(manifest["step"]),
    )
