"""A checkpoint's tensors in ``torch.distributed.checkpoint`` (DCP) format, read safely.

DCP writes one file per writing rank (``__<rank>_0.distcp``) and, once every
rank's data is written, its ``.metadata`` (through a temporary name and a
rename), and reads any tensor by name whichever rank wrote it. Here:

- :func:`write` saves a flat ``{name: tensor}``, in the caller's process group
  or, in the background, in a group of its own (:func:`background_group`), so
  that its collectives never interleave with the training's;
- :func:`read` fills a flat ``{name: tensor}`` of the right shapes;
- DCP's ``.metadata`` is a pickle: :class:`SafeReader` unpickles it with an
  allow-list of DCP's own metadata classes, and a checkpoint's values that are
  not tensors (DCP keeps them as pickles) are refused, so reading a checkpoint
  runs no code from it. Tensors are read by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import pickle
import warnings
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from twobp.runtime.base.group import Membership
from twobp.runtime.errors import CheckpointError

METADATA = ".metadata"
"""DCP's metadata file: written last, once every rank's data is in place."""

FAILURES = (Exception, CheckpointException)
"""What a DCP call raises: its CheckpointException (every rank's failures) is a BaseException."""

_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _Refused(pickle.UnpicklingError):
    """The metadata names an object that is not DCP's (not damage: something else)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: its classes, torch dtypes, sizes, paths."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name} is not part of DCP's metadata")


class SafeReader(FileSystemReader):
    """DCP's file system reader, with the metadata read through an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled with DCP's metadata classes only.

        Raises:
            CheckpointError: if the metadata is missing, damaged (it does not
                unpickle), or holds any other object.
        """
        path = Path(self.path) / METADATA
        try:
            with path.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except _Refused as exc:
            raise CheckpointError(
                f"{path}: {exc}; twobp does not unpickle other objects: is it a DCP checkpoint?"
            ) from None
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
        except Exception as exc:  # what bytes that are not a pickle raise: any of many classes
            raise CheckpointError(
                f"{path} is damaged: it does not read as DCP's metadata "
                f"({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"{path} is damaged: it holds a {type(metadata).__name__}, not DCP's metadata"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Pieces:
    """Boxes of one tensor of a checkpoint, which DCP writes or fills as chunks of it.

    Implements DCP's checkpointable protocol (what a DTensor provides) with
    the planners' help to find a box by its offsets.

    Args:
        size: the whole tensor's shape.
        dtype: its dtype.
        boxes: ``(offsets, tensor)``: each box's offsets and its tensor, of the box's shape.
    """

    def __init__(
        self,
        size: Sequence[int],
        dtype: torch.dtype,
        boxes: Sequence[tuple[tuple[int, ...], Tensor]],
    ) -> None:
        self.size_ = torch.Size(size)
        self.dtype = dtype
        self.boxes = {torch.Size(o): t for o, t in boxes}

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.size_,
                ),
            )
            for offsets, t in self.boxes.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        assert index.offset is not None
        return self.boxes[torch.Size(index.offset)]


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's load planner, refusing values that are not tensors (DCP keeps them as pickles),
    and filling the boxes of :class:`Pieces`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"{read_item.dest_index.fqn} is a pickled object, which twobp does not load"
        )

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # DCP's preparation of the state dict maps the objects it does not know to None.
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        plain = {k: v for k, v in state_dict.items() if k not in pieces}
        super().set_up_planner(plain, metadata, is_coordinator)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, Pieces):
            return found.__get_tensor_shard__(index)
        return super().lookup_tensor(index)  # type: ignore[no-any-return]


class _WithPieces(DefaultSavePlanner):
    """DCP's save planner, writing the boxes of :class:`Pieces` as chunks of their tensor."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = self.state_dict.get(index.fqn)
        if isinstance(found, Pieces):
            return found.__get_tensor_shard__(index)
        return super().lookup_object(index)


def tensor_shapes(folder: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    """Every tensor of the checkpoint in ``folder``: its shape and dtype, from DCP's metadata.

    Raises:
        CheckpointError: if the metadata is missing, damaged, not DCP's or unreadable.
    """
    metadata = SafeReader(folder).read_metadata()
    return {
        name: (list(entry.size), entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def write(
    tensors: dict[str, Any],
    folder: Path,
    group: dist.ProcessGroup | None,
    *,
    background: bool = False,
) -> Future[Any] | None:
    """Write ``tensors`` into the DCP checkpoint ``folder``. Collective over ``group``.

    Args:
        tensors: this rank's tensors, by name (no name on two ranks, but for
            :class:`Pieces` of one tensor); may be empty.
        folder: the checkpoint's folder (it may exist).
        group: the ranks that save together; None: this process alone. A
            background write needs a group of its own (:func:`background_group`).
        background: write in a background thread; the tensors are copied
            first, so training may change them as soon as this returns.

    Returns:
        The future of a background write (its result: DCP's metadata), else None.

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: if any rank failed
            to write (on every rank); a background write raises it from its future.
    """
    writer = FileSystemWriter(folder, sync_files=True)
    alone = group is None
    with _alone_is_meant(alone):
        if background:
            future: Future[Any] = async_save(  # type: ignore[assignment]
                tensors,
                storage_writer=writer,
                planner=_WithPieces(),
                process_group=group,
                no_dist=alone,
            )
            return future
        dcp_save(
            tensors,
            storage_writer=writer,
            planner=_WithPieces(),
            process_group=group,
            no_dist=alone,
        )
    return None


def read(tensors: dict[str, Any], folder: Path, group: dist.ProcessGroup | None) -> None:
    """Fill ``tensors`` (names and shapes as saved) from the checkpoint ``folder``.

    Collective over ``group`` (None: this process alone).

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: on every rank, if
            any rank failed to read.
    """
    with _alone_is_meant(group is None):
        dcp_load(
            tensors,
            storage_reader=SafeReader(folder),
            planner=_TensorsOnly(),
            process_group=group,
            no_dist=group is None,
        )


@contextlib.contextmanager
def _alone_is_meant(alone: bool) -> Iterator[None]:
    """Silence DCP's warning that it assumes one process, when one process is meant."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def background_group(world: Membership, timeout: float) -> dist.ProcessGroup | None:
    """A gloo group of the ranks of ``world`` for background writes (None when alone).

    Collective over ``world``. A background write's collectives run in a thread
    while the training's run in the pipeline's group; in a group of their own,
    the two never meet out of order.
    """
    group = world.group
    if group is None:
        return None
    new: dist.ProcessGroup = dist.new_group(
        ranks=dist.get_process_group_ranks(group),
        backend="gloo",
        timeout=datetime.timedelta(seconds=timeout),
        use_local_synchronization=True,
    )
    return new


def own_failure(error: BaseException, rank: int) -> Exception | None:
    """This rank's part of a DCP error (DCP raises every rank's failures on every rank).

    Returns:
        This rank's exception, or None if only other ranks failed (they report
        theirs themselves), or ``error`` itself if it is not DCP's.
    """
    if not isinstance(error, CheckpointException):
        return error if isinstance(error, Exception) else RuntimeError(str(error))
    mine = error.failures.get(rank)
    if mine is None:
        return None
    found = mine[0]
    return found if isinstance(found, Exception) else RuntimeError(str(found))


def file_extents(folder: Path) -> dict[str, int]:
    """Each data file DCP's metadata points into, and the end of its last byte there.

    Raises:
        CheckpointError: as :meth:`SafeReader.read_metadata`.
    """
    metadata = SafeReader(folder).read_metadata()
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def files_of(folder: Path, names: Collection[str]) -> set[str]:
    """The data files that hold the tensors ``names`` (written by the rank that had them)."""
    metadata = SafeReader(folder).read_metadata()
    return {
        info.relative_path
        for index, info in (metadata.storage_data or {}).items()
        if index.fqn in names
    }


def dcp_files(folder: Path) -> list[str]:
    """The DCP data files in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")


def checkpoint_error(exc: Exception, what: str) -> CheckpointError:
    """``exc`` as a CheckpointError that says ``what`` failed (a CheckpointError stays)."""
    if isinstance(exc, CheckpointError):
        return exc
    error = CheckpointError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def own_error(exc: BaseException, rank: int, what: str) -> CheckpointError | None:
    """This rank's failure in a DCP error, as a CheckpointError (None if only others failed)."""
    own = own_failure(exc, rank)
    return None if own is None else checkpoint_error(own, f"rank {rank} {what}")
