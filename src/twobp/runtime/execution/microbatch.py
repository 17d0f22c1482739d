"""Batches and micro-batches: split along dim 0, join back, flatten to tensors.

A *batch* is what blocks take and return: one tensor, or a tuple of tensors
(for example hidden states and an attention mask). Every tensor of a batch
shares its first dimension, the samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import Batch as Batch


def flatten(batch: Batch, what: str = "value") -> tuple[tuple[Tensor, ...], bool]:
    """The tensors of a batch and whether it was a tuple.

    Raises:
        PipelineConfigError: if it is neither a tensor nor a tuple of tensors.
    """
    if isinstance(batch, Tensor):
        return (batch,), False
    if isinstance(batch, (tuple, list)) and all(isinstance(t, Tensor) for t in batch):
        return tuple(batch), True
    kinds = type(batch).__name__
    if isinstance(batch, (tuple, list)):
        kinds += " of " + ", ".join(type(t).__name__ for t in batch)
    raise PipelineConfigError(
        f"{what} must be a tensor or a tuple of tensors, got {kinds}; blocks of a pipeline "
        "pass tensors only (wrap other values in tensors or keep them inside a block)"
    )


def unflatten(tensors: Sequence[Tensor], is_tuple: bool) -> Batch:
    """Inverse of :func:`flatten`."""
    return tuple(tensors) if is_tuple else tensors[0]


def microbatch_sizes(size: int, n_microbatches: int, what: str = "inputs") -> tuple[int, ...]:
    """The rows of each micro-batch of a batch of ``size`` rows, as ``torch.tensor_split``
    cuts it: the first ``size % n_microbatches`` hold one row more than the others.

    Raises:
        PipelineConfigError: if the batch holds fewer rows than micro-batches.
    """
    if size < n_microbatches:
        raise PipelineConfigError(
            f"the {what} have batch size {size}, fewer rows than the {n_microbatches} "
            f"micro-batches of a step; pass at least {n_microbatches} rows or lower "
            "n_microbatches"
        )
    small, extra = divmod(size, n_microbatches)
    return tuple(small + 1 if m < extra else small for m in range(n_microbatches))


def batch_size(batch: Batch, what: str = "inputs") -> int:
    """The rows of a batch: the first dimension its tensors share.

    Raises:
        PipelineConfigError: if it is not a batch, or the tensors of a tuple
            disagree on it.
    """
    tensors, _ = flatten(batch, what)
    sizes = {t.shape[0] if t.dim() > 0 else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise PipelineConfigError(
            f"every tensor of the {what} needs the same batch size along dim 0, got shapes {shapes}"
        )
    return int(next(iter(sizes)))  # type: ignore[arg-type]


def split_batch(batch: Batch, n_microbatches: int, what: str = "inputs") -> list[Batch]:
    """Split a batch into ``n_microbatches`` micro-batches along dim 0, as
    ``torch.tensor_split`` does: sizes differ by at most one row, the larger first.

    Args:
        batch: a tensor or a tuple of tensors with the same first dimension.
        n_microbatches: how many micro-batches.
        what: names the batch in errors (``"inputs"``, ``"targets"``).

    Returns:
        The micro-batches (views of ``batch``), each of the same structure.

    Raises:
        PipelineConfigError: if the batch holds fewer rows than
            ``n_microbatches``, or the tensors of a tuple disagree on its size.
    """
    tensors, is_tuple = flatten(batch, what)
    sizes = list(microbatch_sizes(batch_size(batch, what), n_microbatches, what))
    chunks = [torch.split(t, sizes, dim=0) for t in tensors]
    return [unflatten([c[m] for c in chunks], is_tuple) for m in range(n_microbatches)]


def concat_microbatches(parts: Sequence[Batch]) -> Batch:
    """Join micro-batches back into one batch along dim 0 (inverse of :func:`split_batch`)."""
    flat = [flatten(p, "output") for p in parts]
    is_tuple = flat[0][1]
    columns = zip(*(tensors for tensors, _ in flat), strict=True)
    return unflatten([torch.cat(col, dim=0) for col in columns], is_tuple)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch with every tensor on ``device``."""
    tensors, is_tuple = flatten(batch)
    return unflatten([t.to(device, non_blocking=True) for t in tensors], is_tuple)
