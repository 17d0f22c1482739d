"""What the input pass leaves behind for the weight pass, and helpers to read it.

The input pass (I) of a deferred op stashes the tensors its weight gradient
needs (for a linear layer: its input ``X`` and output gradient ``dY``). The
weight pass (W) later concatenates the stashes of several micro-batches along
the batch dimension and runs one large operation over them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StashEntry:
    """The tensors one call of a deferred op stashed during I.

    Args:
        tensors: what the op's weight gradient needs, op-specific.
        versions: the version counter of each tensor when it was stashed; an
            in-place change before W would silently corrupt the gradient, so
            W compares them.
    """

    tensors: tuple[Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, tensors: tuple[Tensor, ...]) -> StashEntry:
        """Stash ``tensors`` as they are now."""
        return cls(tensors, tuple(t._version for t in tensors))

    def changed(self) -> bool:
        """True if one of the tensors was modified in place since it was stashed."""
        return any(t._version != v for t, v in zip(self.tensors, self.versions, strict=True))


def held_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of memory that ``tensors`` keep alive, each storage counted once.

    A view keeps its whole storage alive, so storages are counted, not views.
    """
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def cat_rows(tensors: Sequence[Tensor], row_shape: Sequence[int]) -> Tensor:
    """Flatten each tensor to ``(-1, *row_shape)`` and concatenate along dim 0.

    A single tensor is only reshaped (no copy when it is contiguous).
    """
    dims = len(row_shape) + 1
    rows = [t if t.dim() == dims else t.reshape(-1, *row_shape) for t in tensors]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


CONCAT_ROWS = 256
"""Rows from which a matrix product of the weight pass runs near the machine's
peak: stashes are concatenated only up to this many rows. Fewer, larger
products save passes over the weight gradient; past this size a concatenation
costs a copy of the stashes and saves nothing."""


def row_chunks(
    stashes: Sequence[tuple[Tensor, ...]], row_size: int, min_rows: int = CONCAT_ROWS
) -> list[Sequence[tuple[Tensor, ...]]]:
    """Consecutive groups of stashes, each of at least ``min_rows`` rows (but the last).

    Args:
        stashes: the stashes of one layer, in order.
        row_size: elements per row of each stash's first tensor.
        min_rows: rows from which a group is closed.

    Returns:
        The groups; a stash of ``min_rows`` rows or more is a group of its own.
    """
    chunks: list[Sequence[tuple[Tensor, ...]]] = []
    start = rows = 0
    for i, stash in enumerate(stashes):
        rows += stash[0].numel() // max(1, row_size)
        if rows >= min_rows:
            chunks.append(stashes[start : i + 1])
            start, rows = i + 1, 0
    if start < len(stashes):
        chunks.append(stashes[start:])
    return chunks


class SharedRows:
    """Concatenations of stashed inputs, shared by the layers of one weight pass.

    Layers that read the same input (the query, key and value projections of
    an attention block) stash the same tensors; their weight passes run one
    after another, so a concatenation made by one layer is kept for the next
    and dropped after a layer that did not use it.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[object, ...], Tensor] = {}
        self._used: dict[tuple[object, ...], Tensor] = {}

    def next_layer(self) -> None:
        """Start the weight pass of the next layer: keep only what the last one used."""
        self._kept, self._used = self._used, {}

    def cat(self, tensors: Sequence[Tensor], row_shape: Sequence[int]) -> Tensor:
        """:func:`cat_rows` of ``tensors``, made once for every layer that asks in turn."""
        if len(tensors) == 1:
            return cat_rows(tensors, row_shape)
        key = (tuple(row_shape), *((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors))
        rows = self._kept.get(key)
        if rows is None:
            rows = self._used.get(key)
        if rows is None:
            rows = cat_rows(tensors, row_shape)
        self._used[key] = rows
        return rows


def group_by_shape(stashes: Iterable[tuple[Tensor, ...]]) -> list[list[tuple[Tensor, ...]]]:
    """Split stashes into groups whose tensors agree in dtype and in every dim but the first.

    Only such stashes can be concatenated along the batch dimension (e.g.
    convolutions over images of different sizes land in different groups).
    Groups keep the order in which their first member appeared.
    """
    groups: dict[Hashable, list[tuple[Tensor, ...]]] = {}
    for stash in stashes:
        key = tuple((tuple(t.shape[1:]), t.dtype) for t in stash)
        groups.setdefault(key, []).append(stash)
    return list(groups.values())


def accumulate_grad(param: Tensor | None, grad: Tensor) -> None:
    """Add ``grad`` to ``param.grad`` as autograd does: set it if None, else add.

    Does nothing for a missing or frozen parameter.
    """
    if param is None or not param.requires_grad:
        return
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
