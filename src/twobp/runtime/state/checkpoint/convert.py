"""Convert a checkpoint of twobp's first format (a pickle per rank) to the current one.

The first format kept each rank's weights, optimizer state, RNG states and
``extra`` in one ``torch.save`` file (``rank-00000.pt``). They are read here
with ``torch.load(weights_only=True)``, which builds tensors and plain data
only; NumPy's array type is allowed too, for NumPy's RNG state. An ``extra``
that held other objects cannot be converted: the error names it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import integrity
from twobp.runtime.state.checkpoint.entries import (
    check_json,
    model_entries,
    optimizer_entries,
    rng_entries,
)
from twobp.runtime.state.checkpoint.files import (
    VERSION,
    fresh_folder,
    publish,
    read_manifest,
    step_folder,
)

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage

# What NumPy's RNG state needs to unpickle, under NumPy 1 and 2 names.
_NUMPY_GLOBALS = (
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.dtypes.UInt32DType",
)


def convert(old: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """Write the checkpoint ``old`` (first format) into the folder of checkpoints ``root``.

    Not collective: one process reads every rank's file and writes one DCP
    file. The new checkpoint has the same step, so converting into the same
    folder replaces the old one (the others stay as they are).

    Args:
        old: a checkpoint of the first format, or a folder of checkpoints (its latest).
        root: the folder of checkpoints to write into.

    Returns:
        The new checkpoint's folder.

    Raises:
        CheckpointError: if ``old`` is not of the first format, or holds objects
            other than tensors and plain data.
    """
    manifest = read_manifest(old, old=True)
    folder = Path(manifest["path"])
    if manifest["version"] != 1:
        raise CheckpointError(f"{folder} is of the current format already (version {VERSION})")
    parts = [_read_rank_file(folder / name) for name in manifest["files"]]
    tensors: dict[str, Tensor] = {}
    ranks = []
    for rank, part in enumerate(parts):
        tensors.update(model_entries(part["model"]))
        rng_tensors, rng_rest = rng_entries(rank, part["rng"])
        tensors.update(rng_tensors)
        optimizer_json = None
        if part["optimizer"] is not None:
            optimizer_tensors, optimizer_json = optimizer_entries(part["optimizer"])
            tensors.update(optimizer_tensors)
        extra = check_json(part["extra"], f"the extra of rank {rank}")
        ranks.append({"extra": extra, "rng": rng_rest, "optimizer": optimizer_json})
    kept = ("step", "world_size", "schedule", "n_microbatches", "placement", "stage_blocks")
    new_manifest = {
        "format": manifest["format"],
        "version": VERSION,
        "storage": "torch.distributed.checkpoint",
        **{key: manifest[key] for key in kept},
        "optimizer": manifest["optimizer"],
        "tensors": {
            name: {"shape": e["shape"], "dtype": e["dtype"], "rank": e["file"]}
            for name, e in manifest["tensors"].items()
        },
        "ranks": ranks,
        "meta": manifest["meta"],
        "created": manifest["created"],
    }
    final = Path(root) / step_folder(manifest["step"])
    partial = final.with_name(f".partial-{final.name}")
    try:
        fresh_folder(partial)
        storage.write(tensors, partial, None)
        new_manifest["files"] = integrity.record(partial, integrity.all_files(partial))
        publish(partial, final, new_manifest, keep=None)
    except storage.FAILURES as exc:
        own = storage.own_failure(exc, 0) or RuntimeError(str(exc))
        raise CheckpointError(f"cannot write {final}: {type(own).__name__}: {own}") from None
    return final


def _read_rank_file(path: Path) -> dict[str, Any]:
    allowed = [_resolve(name) for name in _NUMPY_GLOBALS]
    try:
        with torch.serialization.safe_globals([g for g in allowed if g is not None]):
            part: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data, which twobp does not "
            f"unpickle ({first}); load it with the twobp that wrote it and save its content "
            "as JSON"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:  # what a truncated or overwritten file raises: many classes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{path} is damaged: it does not read as a torch.save file "
            f"({type(exc).__name__}: {first})"
        ) from None
    return part


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core under NumPy 2
            return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
