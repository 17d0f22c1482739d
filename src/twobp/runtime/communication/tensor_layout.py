"""The layout of what crosses a stage boundary: shapes, dtypes, gradient flags.

The sender of the first activation of a boundary, for one size of micro-batch
and one signature of the step's inputs, describes it once in a small
fixed-size integer message; the receiver allocates its buffers from it for
every later micro-batch and step of those shapes. A rank that failed before it could describe
an activation sends a failure message in its place. Gradients need no message: the gradient of
a boundary has the layout of its activations that require grad, which both
sides already know.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MESSAGE_LENGTH = 256
"""Integers in a metadata message (fixed, so the receiver can post it blind)."""

_MAGIC = 0x2B9
_FAILED = 0x2BA
_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and gradient flag of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: Tensor) -> TensorMeta:
        """The layout of ``tensor``."""
        return cls(tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad))

    def __str__(self) -> str:
        grad = ", requires grad" if self.requires_grad else ""
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}{grad}"


@dataclass(frozen=True)
class BoundaryMeta:
    """The layout of one micro-batch's activation at one stage boundary.

    Args:
        tensors: the layout of each tensor, in order.
        is_tuple: whether the block returned a tuple (else one tensor).
    """

    tensors: tuple[TensorMeta, ...]
    is_tuple: bool

    @classmethod
    def of(cls, tensors: Sequence[Tensor], is_tuple: bool) -> BoundaryMeta:
        """The layout of an activation."""
        return cls(tuple(TensorMeta.of(t) for t in tensors), is_tuple)

    @property
    def gradient(self) -> tuple[TensorMeta, ...]:
        """The layout of the gradient sent back: one per tensor that requires grad."""
        return tuple(t for t in self.tensors if t.requires_grad)

    def encode(self) -> Tensor:
        """This layout as a fixed-length int64 message.

        Raises:
            ValueError: if it does not fit in :data:`MESSAGE_LENGTH` integers
                or uses a dtype the runtime cannot send.
        """
        values = [_MAGIC, int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            if t.dtype not in _DTYPES:
                raise ValueError(f"cannot send tensors of dtype {t.dtype} between stages")
            values += [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape), *t.shape]
        if len(values) > MESSAGE_LENGTH:
            raise ValueError(
                f"the activation ({len(self.tensors)} tensors) is too large to describe in "
                f"{MESSAGE_LENGTH} integers; pass fewer tensors between blocks"
            )
        message = torch.zeros(MESSAGE_LENGTH, dtype=torch.int64)
        message[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return message

    @classmethod
    def decode(cls, message: Tensor) -> BoundaryMeta:
        """Inverse of :meth:`encode`.

        Raises:
            ValueError: if the message is not a layout message.
        """
        values = [int(v) for v in message.tolist()]
        if values[0] != _MAGIC:
            raise ValueError(
                "received a message that is not a tensor layout; the two ranks disagree on "
                "the order of transfers (do all ranks run the same schedule and model?)"
            )
        is_tuple, count, pos = bool(values[1]), values[2], 3
        tensors = []
        for _ in range(count):
            dtype, grad, ndim = values[pos : pos + 3]
            shape = tuple(values[pos + 3 : pos + 3 + ndim])
            tensors.append(TensorMeta(shape, _DTYPES[dtype], bool(grad)))
            pos += 3 + ndim
        return cls(tuple(tensors), is_tuple)


def failure_message() -> Tensor:
    """The message a failed rank sends instead of a layout it never learnt.

    The receiver then expects no tensors for that transfer (see
    :meth:`twobp.runtime.communication.channel.StepChannel.drain`).
    """
    message = torch.zeros(MESSAGE_LENGTH, dtype=torch.int64)
    message[0] = _FAILED
    return message


def is_failure_message(message: Tensor) -> bool:
    """True for a :func:`failure_message`."""
    return int(message[0]) == _FAILED


def describe_mismatch(expected: Sequence[TensorMeta], got: Sequence[TensorMeta]) -> str | None:
    """What differs between two layouts, or None if they are the same."""
    if len(expected) != len(got):
        return f"{len(got)} tensors instead of {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if e != g:
            return f"tensor {i} is {g} instead of {e}"
    return None
