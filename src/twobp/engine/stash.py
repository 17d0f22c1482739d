"""What the input pass leaves behind for the weight pass, and helpers to read it.

The input pass (I) of a covered layer stashes the tensors its weight gradient
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
    """The tensors one call of a covered layer stashed during I.

    Args:
        tensors: what the layer's weight gradient needs, layer-specific.
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


def group_by_shape(stashes: Iterable[tuple[Tensor, ...]]) -> list[list[tuple[Tensor, ...]]]:
    """Split stashes into groups whose tensors agree in every dim but the first.

    Only such stashes can be concatenated along the batch dimension (e.g.
    convolutions over images of different sizes land in different groups).
    Groups keep the order in which their first member appeared.
    """
    groups: dict[Hashable, list[tuple[Tensor, ...]]] = {}
    for stash in stashes:
        key = tuple(tuple(t.shape[1:]) for t in stash)
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
