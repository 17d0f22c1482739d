"""Where a checkpoint's files go and how they are found, written atomically.

See :mod:`twobp.runtime.state.checkpoint` for the layout. Nothing here communicates:
these are the file operations of one process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from twobp.runtime.errors import CheckpointError

FORMAT = "twobp-checkpoint"
VERSION = 2
"""2: tensors in torch.distributed.checkpoint format, the rest in the manifest as JSON.
1: one pickle per rank (``rank-00000.pt``); ``twobp checkpoint convert`` turns it into 2."""
MANIFEST = "manifest.json"
_MANIFEST_KEYS = (
    "step", "world_size", "schedule", "n_microbatches", "placement", "stage_blocks",
    "optimizer", "tensors", "ranks",
)  # fmt: skip
"""What every manifest of the current format holds (``files`` only since sizes were recorded)."""
_STEP_FOLDER = re.compile(r"^(?:\.partial-|\.replaced-)?step-(\d+)$")


def step_folder(step: int) -> str:
    """The name of the checkpoint of step ``step`` in a folder of checkpoints."""
    return f"step-{step:08d}"


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is one complete checkpoint (it has its manifest)."""
    return (Path(path) / MANIFEST).is_file()


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint of the highest step in a folder of checkpoints, or None.

    Folders a crash left behind count if they are complete (a manifest is
    written only once every rank's file is in place).
    """
    found = complete_checkpoints(root)
    return found[0] if found else None


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in a folder of checkpoints, the highest step first.

    Of two folders of one step (a crash between the renames of a save), the
    published ``step-*`` one comes first.
    """
    found: list[tuple[int, int, Path]] = []
    folder = Path(root)
    if not folder.is_dir():
        return []
    for child in folder.iterdir():
        match = _STEP_FOLDER.match(child.name)
        if match and is_checkpoint(child):
            preferred = 1 if child.name.startswith("step-") else 0
            found.append((int(match.group(1)), preferred, child))
    return [path for *_, path in sorted(found, reverse=True)]


def step_of(folder: Path) -> int | None:
    """The step of a checkpoint folder named as a save names it, else None."""
    match = _STEP_FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint ``path`` names: itself, or the latest one inside it.

    Args:
        path: a checkpoint, a folder of checkpoints, or a folder holding a
            ``checkpoints`` folder (the output folder of ``twobp train``).

    Raises:
        CheckpointError: if there is no complete checkpoint there.
    """
    folder = Path(path)
    if is_checkpoint(folder):
        return folder
    for root in (folder, folder / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    what = "does not exist" if not folder.exists() else "holds no complete checkpoint"
    raise CheckpointError(
        f"{folder} {what}: give a checkpoint folder (with {MANIFEST}), a folder of "
        "checkpoints or the output folder of a run that saved some"
    )


def read_manifest(path: str | os.PathLike[str], *, old: bool = False) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` names (see :func:`find_checkpoint`).

    Args:
        path: a checkpoint, a folder of checkpoints or a run's output folder.
        old: accept a checkpoint of the first format too (version 1).

    Raises:
        CheckpointError: if there is none, it is damaged (not JSON, a key missing),
            not a twobp manifest, or of the first format (it names the command
            that converts it).
    """
    folder = find_checkpoint(path)
    manifest = _manifest_json(folder / MANIFEST)
    version = manifest.get("version", 0)
    if manifest.get("format") != FORMAT or not 1 <= version <= VERSION:
        raise CheckpointError(
            f"{folder / MANIFEST} is not a twobp checkpoint manifest of version <= {VERSION}"
        )
    lacking = [key for key in _MANIFEST_KEYS if key not in manifest] if version > 1 else []
    if lacking:
        raise CheckpointError(
            f"{folder / MANIFEST} is damaged: it lacks {', '.join(map(repr, lacking))}"
        )
    if version == 1 and not old:
        raise CheckpointError(
            f"{folder} is a checkpoint of twobp's first format (a pickle per rank), which "
            f"twobp no longer loads: convert it once with `twobp checkpoint convert {folder} "
            "NEW_FOLDER` (it reads tensors and plain data only)"
        )
    manifest["path"] = str(folder)
    return manifest


def _manifest_json(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{path} is damaged: it is not valid JSON ({exc.msg} at line {exc.lineno} "
            f"column {exc.colno})"
        ) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is damaged: it is not text (not valid UTF-8)") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is damaged: it holds a {type(manifest).__name__}")
    return manifest


# -- writing ---------------------------------------------------------------------------


def fresh_folder(partial: Path) -> None:
    """Create ``partial`` empty (a crashed save may have left one of that name)."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()


def publish(partial: Path, final: Path, manifest: dict[str, Any], keep: int | None) -> None:
    """Mark ``partial`` complete, move it into place, then drop what it replaces.

    Args:
        partial: the folder holding every rank's data.
        final: where the checkpoint goes.
        manifest: written into ``partial`` last.
        keep: checkpoints to keep in the folder, this one included (see
            :func:`prune`); None: leave the others as they are.
    """
    text = json.dumps(manifest, indent=1)
    write_atomic(partial / MANIFEST, lambda f: f.write(text.encode()))
    fsync_folder(partial)
    replaced = final.with_name(f".replaced-{final.name}")
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        final.rename(replaced)
    partial.rename(final)
    fsync_folder(final.parent)
    if keep is not None:
        prune(final, keep)
    elif replaced.exists():
        shutil.rmtree(replaced)


def prune(final: Path, keep: int) -> None:
    """Delete leftovers, later steps (a rolled-back run) and all but ``keep`` checkpoints."""
    step = int(final.name.removeprefix("step-"))
    complete = []
    for child in final.parent.iterdir():
        match = _STEP_FOLDER.match(child.name)
        if match is None or child == final:
            continue
        if not child.name.startswith("step-") or int(match.group(1)) > step:
            shutil.rmtree(child, ignore_errors=True)
        else:
            complete.append((int(match.group(1)), child))
    for _, child in sorted(complete)[: max(0, len(complete) - (keep - 1))]:
        shutil.rmtree(child, ignore_errors=True)


def write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write a file through a temporary name, fsync it, then rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def fsync_folder(folder: Path) -> None:
    """Make the renames inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
