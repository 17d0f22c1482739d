"""Matrix products with a parameter operand: ``torch.addmm``, ``mm``, ``matmul``, ``@``, ``bmm``.

The parameter ``P`` is either operand. On the right (``y = x @ P``, GPT-2's
``Conv1D`` as ``torch.addmm(bias, x, P)``) I computes ``dx = dY @ P^T`` and W
``dP = cat(x)^T @ cat(dY)`` over the rows of every stashed call; on the left
(``y = P @ x``, Mamba's ``dt_proj.weight @ x``) I computes ``dx = P^T @ dY``
and W ``dP = cat(dY) @ cat(x)^T`` over the columns. A 2-D parameter takes any
batch dimensions of ``x``; a batched parameter (``bmm``) takes an ``x`` with
the same batch dimensions, and W concatenates per batch entry. Float16
stashes give float32 products (:mod:`twobp.engine.precision`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from twobp.engine.capture import Capture, Captured, Kwargs, bind
from twobp.engine.deferred import DeferredOp, in_input_dtype
from twobp.engine.operand import Operand, cast
from twobp.engine.precision import row_sum, weight_matmul, weight_mm
from twobp.engine.stash import SharedRows, cat_rows, row_chunks


class DeferredMatmul(DeferredOp):
    """``x @ P (+ bias)`` or ``P @ x``.

    ``options`` is ``(side, batched)``: the parameter's side (``"right"`` or
    ``"left"``) and whether it has batch dimensions.
    """

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype = call[0]
        weight, bias = self.weights(params, dtype)
        assert weight is not None
        xc = cast(x, dtype)
        if self.options[0] == "left":
            out = torch.matmul(weight, xc)
        elif bias is not None:
            out = torch.addmm(bias, xc, weight)
        else:
            out = torch.matmul(xc, weight)
        return out, (xc, weight), x.dtype

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight = saved
        grad_in = None
        if needs_input_grad:
            if self.options[0] == "left":
                grad_in = torch.matmul(weight.mT, grad_out)
            else:
                grad_in = torch.matmul(grad_out, weight.mT)
            grad_in = in_input_dtype(grad_in, state)
        return grad_in, (x, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.operands
        assert weight is not None
        side, batched = self.options
        if weight.param.requires_grad:
            if batched:
                _batched_weight_grads(weight, side, stashes)
            elif side == "left":
                _left_weight_grads(weight, stashes)
        if side == "right" and not batched:
            # The right-hand product and the bias read the same rows.
            _right_weight_grads(weight, bias, stashes, shared)


def _right_weight_grads(
    weight: Operand,
    bias: Operand | None,
    stashes: Sequence[tuple[Tensor, ...]],
    shared: SharedRows,
) -> None:
    k, m = stashes[0][0].shape[-1], stashes[0][1].shape[-1]
    for chunk in row_chunks(stashes, k):
        x = shared.cat([s[0] for s in chunk], (k,))
        dy = cat_rows([s[1] for s in chunk], (m,))
        if weight.param.requires_grad:
            weight.add_grad(weight_mm(x.t(), dy))
        if bias is not None:
            bias.add_grad(row_sum(dy))


def _left_weight_grads(weight: Operand, stashes: Sequence[tuple[Tensor, ...]]) -> None:
    x0, dy0 = stashes[0]
    k = x0.shape[0] if x0.dim() == 1 else x0.shape[-2]
    m = dy0.shape[0] if dy0.dim() == 1 else dy0.shape[-2]
    # The columns of x (..., k, n) and dY (..., m, n) are the rows of the product.
    xs = [_columns(s[0], k) for s in stashes]
    dys = [_columns(s[1], m) for s in stashes]
    x = xs[0] if len(xs) == 1 else torch.cat(xs)
    dy = dys[0] if len(dys) == 1 else torch.cat(dys)
    weight.add_grad(weight_mm(dy.t(), x))


def _batched_weight_grads(
    weight: Operand, side: str, stashes: Sequence[tuple[Tensor, ...]]
) -> None:
    dim = -2 if side == "right" else -1
    x = torch.cat([s[0] for s in stashes], dim=dim)
    dy = torch.cat([s[1] for s in stashes], dim=dim)
    weight.add_grad(weight_matmul(x.mT, dy) if side == "right" else weight_matmul(dy, x.mT))


def _columns(t: Tensor, size: int) -> Tensor:
    """The columns of ``t`` (``(..., size, n)``, or ``(size,)``) as rows: ``(-1, size)``."""
    return t.reshape(1, size) if t.dim() == 1 else t.movedim(-2, -1).reshape(-1, size)


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, Tensor) else None


def _matmul(capture: Capture, a: Any, b: Any, name: str) -> Captured:
    """``a @ b`` with a stage parameter on one side (both sides: left to autograd)."""
    left, right = capture.operand(a), capture.operand(b)
    if left and right:
        return f"{name} of two parameters"
    param, x, side = (left, b, "left") if left else (right, a, "right")
    if not param or not isinstance(x, Tensor):
        return None
    p_shape = _shape(a if side == "left" else b)
    assert p_shape is not None
    if len(p_shape) < 2 or x.dim() < 1:
        return f"{name} with a {len(p_shape)}-D parameter"
    batched = len(p_shape) > 2
    if batched and tuple(x.shape[:-2]) != p_shape[:-2]:
        return f"{name} broadcasting over a parameter's batch dimensions"
    return capture.run(DeferredMatmul, name, (side, batched), x, param, None)


_TWO = (("input", "other"), ())
_MM = (("input", "mat2"), ())
_ADDMM = (("input", "mat1", "mat2", "beta", "alpha"), (1, 1))


def capture_matmul(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.matmul`` / ``Tensor.matmul`` / ``@`` with a stage parameter operand."""
    bound = bind(args, kwargs, *_TWO)
    return None if bound is None else _matmul(capture, bound[0], bound[1], "torch.matmul")


def capture_mm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.mm`` / ``Tensor.mm`` with a stage parameter operand."""
    bound = bind(args, kwargs, *_MM)
    return None if bound is None else _matmul(capture, bound[0], bound[1], "torch.mm")


def capture_bmm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.bmm`` / ``Tensor.bmm`` with a stage parameter operand."""
    bound = bind(args, kwargs, *_MM)
    return None if bound is None else _matmul(capture, bound[0], bound[1], "torch.bmm")


def capture_addmm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.addmm(bias, x, P)`` with a stage parameter ``P`` (GPT-2's ``Conv1D``)."""
    bound = bind(args, kwargs, *_ADDMM)
    if bound is None:
        return None
    bias, x, weight, beta, alpha = bound
    w = capture.operand(weight)
    if not w:
        return None if not capture.operand(x) else "torch.addmm with a parameter as mat1"
    b = capture.operand(bias)
    if b is False or beta != 1 or alpha != 1:
        return "torch.addmm with a bias that is not a parameter, or with beta or alpha"
    if b is not None and _shape(bias) != (_shape(weight) or (0, 0))[-1:]:
        return "torch.addmm with a bias that is broadcast over more than the rows"
    return capture.run(DeferredMatmul, "torch.addmm", ("right", False), x, w, b)
