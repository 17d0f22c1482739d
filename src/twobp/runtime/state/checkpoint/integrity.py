"""Whether a checkpoint's files are intact: their sizes and CRC-32s, recorded and checked.

A save records, in the manifest's ``files``, the size and CRC-32 of every
file of the checkpoint but the manifest itself (the DCP data files and
``.metadata``)::

    "files": {".metadata": {"bytes": 986, "crc32": "5b1e0c2a"},
              "__0_0.distcp": {"bytes": 3154, "crc32": "0f3a9e71"}, ...}

Each rank reads back the files it has just written, in parallel and from the
page cache; in a background save, rank 0 reads them all in the writing
thread, off the training's path. CRC-32 (zlib's, a few GB/s on one core)
finds truncation, flipped bits and overwritten blocks; it is no defence
against a forger, and needs none: nothing in a checkpoint runs code (see
:mod:`.storage`).

:func:`check` compares a checkpoint with what is known of it: every file the
manifest records is there with its size (and CRC-32, when asked), DCP's
metadata reads, and every data file reaches the last byte the metadata points
into. A checkpoint saved before sizes were recorded is checked for all but
those. Whatever is wrong raises a :class:`CheckpointError` that names the file,
what is wrong with it and, if there is one, the previous intact checkpoint.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint.files import (
    MANIFEST,
    complete_checkpoints,
    find_checkpoint,
    read_manifest,
    step_of,
)

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage

CHECKSUM = "crc32"
"""The checksum recorded for each file: zlib's CRC-32, as 8 hex digits."""
_CHUNK = 16 << 20


def crc32(path: Path) -> str:
    """The CRC-32 of the file ``path``, as 8 hex digits."""
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def record(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The size and CRC-32 of each file ``names`` of ``folder``, for the manifest's ``files``."""
    return {
        name: {"bytes": (folder / name).stat().st_size, CHECKSUM: crc32(folder / name)}
        for name in sorted(names)
    }


def all_files(folder: Path) -> list[str]:
    """Every file of a checkpoint being written: all it holds but the manifest."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def written_files(folder: Path, tensors: Iterable[str], coordinator: bool) -> list[str]:
    """The files of a just-written checkpoint that one rank records.

    Args:
        folder: the checkpoint's folder (DCP's metadata written).
        tensors: the names of the tensors this rank wrote.
        coordinator: rank 0, which also records DCP's metadata and any file
            that holds no tensor (that of a rank that had none to write).
    """
    mine = storage.files_of(folder, set(tensors))
    if coordinator:
        holding = set(storage.file_extents(folder))
        mine |= {name for name in all_files(folder) if name not in holding}
    return sorted(mine)


# -- checking ---------------------------------------------------------------------------


def damage(
    folder: Path,
    manifest: Mapping[str, Any],
    *,
    checksums: bool = True,
    share: tuple[int, int] = (0, 1),
) -> list[str]:
    """What is wrong with the files of the checkpoint ``folder``: one line per file.

    Args:
        folder: the checkpoint.
        manifest: its manifest (:func:`read_manifest`).
        checksums: also compute and compare the CRC-32 of every recorded file
            (reads them all); else sizes only.
        share: ``(rank, size)``: compute the CRC-32s of every ``size``-th
            file from the ``rank``-th on, so that ranks split the reading.

    Returns:
        ``"<file> is missing"``, ``"<file> is truncated: ..."`` and the like;
        empty if the files are intact.
    """
    found: dict[str, str] = {}
    recorded: Mapping[str, Any] = manifest.get("files") or {}
    for name, entry in sorted(recorded.items()):
        size = _size(folder / name)
        if size is None:
            found[name] = f"{folder / name} is missing"
        elif size < entry["bytes"]:
            found[name] = (
                f"{folder / name} is truncated: {size:,} bytes of the {entry['bytes']:,} it "
                "had when saved"
            )
        elif size > entry["bytes"]:
            found[name] = (
                f"{folder / name} is damaged: {size:,} bytes, {entry['bytes']:,} when saved"
            )
    if storage.METADATA not in found:
        try:
            ends = storage.file_extents(folder)
        except CheckpointError as exc:
            found[storage.METADATA] = str(exc)
            ends = {}
        for name, end in sorted(ends.items()):
            size = _size(folder / name)
            if name in found:
                continue
            if size is None:
                found[name] = f"{folder / name} is missing"
            elif size < end:
                found[name] = (
                    f"{folder / name} is truncated: {size:,} bytes, but its tensors reach "
                    f"byte {end:,}"
                )
    if checksums:
        rank, size = share
        unchecked = [name for name in sorted(recorded) if name not in found]
        for name in unchecked[rank::size]:
            want, got = recorded[name].get(CHECKSUM), crc32(folder / name)
            if want is not None and got != want:
                found[name] = (
                    f"{folder / name} is damaged: its CRC-32 is {got}, {want} when saved (the "
                    "file changed since)"
                )
    return [found[name] for name in sorted(found)]


def check(
    path: str | os.PathLike[str], *, checksums: bool = True, share: tuple[int, int] = (0, 1)
) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` names, once its files are found intact.

    Args:
        path: a checkpoint, a folder of checkpoints or a run's output folder
            (see :func:`find_checkpoint`).
        checksums: compare CRC-32s too (see :func:`damage`).
        share: the part of the CRC-32s to compute (see :func:`damage`).

    Raises:
        CheckpointError: if there is no checkpoint there, or its manifest or
            any file is damaged; the message names the file, what is wrong and
            the previous intact checkpoint, if there is one.
    """
    manifest = checked_manifest(path)
    folder = Path(manifest["path"])
    found = damage(folder, manifest, checksums=checksums, share=share)
    if found:
        raise damaged_error(folder, found)
    return manifest


def checked_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """:func:`read_manifest`, whose error names the previous intact checkpoint too.

    Raises:
        CheckpointError: as :func:`read_manifest`.
    """
    folder = find_checkpoint(path)
    try:
        return read_manifest(folder)
    except CheckpointError as exc:
        raise damaged_error(folder, [str(exc)]) from None


def damaged_error(folder: Path, found: list[str]) -> CheckpointError:
    """The error of the checkpoint ``folder`` with the problems ``found``.

    It names the first problem, how many more there are, and the previous
    intact checkpoint (see :func:`previous_intact`), if there is one.
    """
    more = f" (and {len(found) - 1} more: see twobp checkpoint info)" if found[1:] else ""
    previous = previous_intact(folder)
    hint = f"; the previous intact checkpoint is {previous}" if previous is not None else ""
    return CheckpointError(f"{found[0]}{more}{hint}")


def is_intact(folder: Path, *, checksums: bool = False) -> bool:
    """True if the checkpoint ``folder``'s manifest reads and :func:`damage` finds nothing."""
    try:
        return not damage(folder, read_manifest(folder), checksums=checksums)
    except CheckpointError:
        return False


def previous_intact(folder: Path) -> Path | None:
    """The newest checkpoint of an earlier step than ``folder``, beside it, that is intact.

    Intact here: its manifest reads and its files have their sizes (the
    CRC-32s are not computed: that would read every file of every checkpoint).
    """
    step = step_of(folder)
    if step is None:
        return None
    for candidate in complete_checkpoints(folder.parent):
        earlier = step_of(candidate)
        if earlier is not None and earlier < step and is_intact(candidate):
            return candidate
    return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None
