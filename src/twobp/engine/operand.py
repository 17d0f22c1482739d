"""A stage parameter as an operation reads it: the parameter itself, or a view or cast of it.

Model code does not always hand a parameter straight to the operation:
Mamba's convolution reads ``weight.squeeze(1).unsqueeze(1)``, a transposed
weight goes into a ``matmul``, mixed-precision code casts a weight with
``weight.to(x.dtype)``. Such a chain of reshapes, transposes and casts is a
list of :data:`Step`: W computes the gradient of the tensor the operation read
and maps it back through the inverse steps to the parameter's shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

Step = tuple[Any, ...]
"""One step from a parameter to what an operation reads, hashable:
``("reshape", new_shape, old_shape)``, ``("transpose", dim0, dim1)``,
``("cast", new_dtype, old_dtype)`` or ``("select", index, old_shape)`` (one
expert's slice ``w[e]`` of stacked expert weights ``[experts, out, in]``)."""


class Operand:
    """A parameter, read through ``steps``.

    Args:
        param: the stage parameter.
        steps: the views and casts between the parameter and the operand, in order.
    """

    __slots__ = ("key", "param", "steps")

    def __init__(self, param: nn.Parameter, steps: tuple[Step, ...] = ()) -> None:
        self.param = param
        self.steps = steps
        self.key = (id(param), steps)
        """Identifies the operand among those of one store (part of an op's identity)."""

    def then(self, step: Step) -> Operand:
        """This operand read through one more step."""
        return Operand(self.param, (*self.steps, step))

    def read(self, param: Tensor, dtype: torch.dtype | None) -> Tensor:
        """``param`` through the steps, then cast to ``dtype`` (None: no cast).

        Args:
            param: the parameter as passed to the Function (this operand's).
            dtype: autocast's dtype for the operation, or None.
        """
        t = param
        for step in self.steps:
            t = _FORWARD[step[0]](t, step)
        return cast(t, dtype)

    def add_grad(self, grad: Tensor) -> None:
        """Add the gradient of the tensor the operation read into the parameter's ``.grad``.

        The gradient goes back through the inverse steps; it is added in the
        parameter's dtype (float32 master weights under autocast), as autograd
        does. Nothing is added to a frozen parameter.
        """
        param = self.param
        if not param.requires_grad:
            return
        steps = self.steps
        if steps and steps[0][0] == "select":
            # One expert's slice: added in place into its rows of .grad, not
            # through a zero-filled tensor of every expert.
            for step in reversed(steps[1:]):
                grad = _INVERSE[step[0]](grad, step)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            param.grad[steps[0][1]].add_(grad)
            return
        for step in reversed(steps):
            grad = _INVERSE[step[0]](grad, step)
        if param.grad is None:
            grad = grad.to(param.dtype)
            # A view or an alias of a stash would pin it; .grad gets its own memory.
            param.grad = grad.contiguous() if self.steps else grad
        else:
            param.grad.add_(grad)


def cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` in ``dtype`` where autocast would cast it: floating, not float64, other dtype."""
    if dtype is None or t.dtype == dtype or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


_FORWARD: dict[str, Callable[[Tensor, Step], Tensor]] = {
    "reshape": lambda t, s: t.reshape(s[1]),
    "transpose": lambda t, s: t.transpose(s[1], s[2]),
    "cast": lambda t, s: t.to(s[1]),
    "select": lambda t, s: t[s[1]],
}
_INVERSE: dict[str, Callable[[Tensor, Step], Tensor]] = {
    "reshape": lambda t, s: t.reshape(s[2]),
    "transpose": lambda t, s: t.transpose(s[1], s[2]),
    "cast": lambda t, s: t.to(s[2]),
    "select": lambda t, s: t.new_zeros(s[2]).index_copy_(0, _index(t, s[1]), t.unsqueeze(0)),
}


def _reshape(src: Tensor, out: Tensor, args: tuple[Any, ...]) -> Step | None:
    if out.dtype != src.dtype:  # Tensor.view(dtype) reinterprets bits
        return None
    return ("reshape", tuple(out.shape), tuple(src.shape))


def _matrix_transpose(src: Tensor, out: Tensor, args: tuple[Any, ...]) -> Step | None:
    return ("transpose", 0, 1) if src.dim() == 2 else None


def _transpose_last(src: Tensor, out: Tensor, args: tuple[Any, ...]) -> Step | None:
    return ("transpose", -2, -1) if src.dim() >= 2 else None


def _transpose(src: Tensor, out: Tensor, args: tuple[Any, ...]) -> Step | None:
    if len(args) != 3 or not all(isinstance(d, int) for d in args[1:]):
        return None
    return ("transpose", args[1], args[2])


def _select(src: Tensor, out: Tensor, args: tuple[Any, ...]) -> Step | None:
    """``w[e]``: one entry of the first dimension, by an int or a 0-D integer tensor."""
    if len(args) != 2 or src.dim() < 2:
        return None
    index = args[1]
    if isinstance(index, Tensor):
        if index.dim() != 0 or index.is_floating_point() or index.dtype == torch.bool:
            return None
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool):
        return None
    return ("select", index % src.shape[0], tuple(src.shape))


def _index(t: Tensor, index: int) -> Tensor:
    return torch.tensor([index], device=t.device)


def _cast(src: Tensor, out: Tensor, args: tuple[Any, ...]) -> Step | None:
    if out.shape != src.shape or out.device != src.device:
        return None
    return ("cast", out.dtype, src.dtype)


VIEW_STEPS: dict[Callable[..., Any], Callable[[Tensor, Tensor, tuple[Any, ...]], Step | None]] = {
    torch.Tensor.reshape: _reshape,
    torch.Tensor.view: _reshape,
    torch.Tensor.view_as: _reshape,
    torch.Tensor.reshape_as: _reshape,
    torch.Tensor.squeeze: _reshape,
    torch.Tensor.unsqueeze: _reshape,
    torch.Tensor.flatten: _reshape,
    torch.Tensor.unflatten: _reshape,
    torch.reshape: _reshape,
    torch.squeeze: _reshape,
    torch.unsqueeze: _reshape,
    torch.flatten: _reshape,
    torch.Tensor.t: _matrix_transpose,
    torch.t: _matrix_transpose,
    # Attribute reads, as the capture sees them.
    torch._C.TensorBase.__dict__["T"].__get__: _matrix_transpose,
    torch._C.TensorBase.__dict__["mT"].__get__: _transpose_last,
    torch.Tensor.transpose: _transpose,
    torch.transpose: _transpose,
    torch.Tensor.__getitem__: _select,
    torch.Tensor.to: _cast,
    torch.Tensor.float: _cast,
    torch.Tensor.half: _cast,
    torch.Tensor.bfloat16: _cast,
    torch.Tensor.double: _cast,
    torch.Tensor.type_as: _cast,
}
"""Operations that read a whole parameter as a reshape, a transpose or a cast of it,
and the :data:`Step` each makes (None where a call is not such a step)."""
