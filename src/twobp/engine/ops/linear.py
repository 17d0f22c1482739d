"""``F.linear`` with a deferred weight gradient.

I computes ``dX = dY @ W``; W computes ``dW = cat(dY)^T @ cat(X)`` and
``db = sum(cat(dY))``, whatever the leading dimensions of the stashed calls
(float16 stashes in float32: :mod:`twobp.engine.precision`).
Stashes are concatenated only up to :data:`~twobp.engine.stash.CONCAT_ROWS`
rows per product: small micro-batches gain from fewer, larger products (fewer
passes over the gradient), large ones would only pay for the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from twobp.engine.capture import Capture, Captured, Kwargs, bind
from twobp.engine.deferred import DeferredOp, in_input_dtype
from twobp.engine.operand import cast
from twobp.engine.precision import row_sum, weight_mm
from twobp.engine.stash import SharedRows, cat_rows, row_chunks


class DeferredLinear(DeferredOp):
    """``F.linear(x, weight, bias)`` (with or without bias, any leading dimensions)."""

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype = call[0]
        if dtype is None and self.plain:
            weight, bias = params
            input_dtype = None
        else:
            weight, bias = self.weights(params, dtype)
            input_dtype, x = x.dtype, cast(x, dtype)
        assert weight is not None
        return F.linear(x, weight, bias), (x, weight), input_dtype

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight = saved
        grad_in = None
        if needs_input_grad:
            grad_in = grad_out.matmul(weight)
            grad_in = in_input_dtype(grad_in, state)
        return grad_in, (x, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.operands
        assert weight is not None
        param = weight.param
        out_features, in_features = stashes[0][1].shape[-1], stashes[0][0].shape[-1]
        # In place into .grad where it holds the product as is: saves a
        # temporary and a pass over the gradient.
        direct = not weight.steps
        for chunk in row_chunks(stashes, in_features):
            x = shared.cat([s[0] for s in chunk], (in_features,))
            dy = cat_rows([s[1] for s in chunk], (out_features,))
            if param.requires_grad:
                grad = param.grad
                if direct and grad is not None and grad.dtype == dy.dtype:
                    grad.addmm_(dy.t(), x)
                elif direct and grad is None and param.dtype == dy.dtype:
                    param.grad = torch.mm(dy.t(), x)
                else:
                    weight.add_grad(weight_mm(dy.t(), x))
            if bias is not None:
                bias.add_grad(row_sum(dy))


_LINEAR = (("input", "weight", "bias"), (None,))


def capture_linear(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.linear(input, weight, bias=None)`` with a stage parameter as ``weight``."""
    if len(args) == 3 and not kwargs:  # as nn.Linear calls it
        x, weight, bias = args
    else:
        bound = bind(args, kwargs, *_LINEAR)
        if bound is None:
            return None
        x, weight, bias = bound
    parameters = capture.parameters
    w = parameters.get(id(weight)) or capture.operand(weight)
    if not w:
        return None
    b = parameters.get(id(bias)) or capture.operand(bias)
    if b is False:
        return "F.linear with a bias that is not a parameter"
    if weight.dim() != 2 or (bias is not None and bias.dim() != 1):
        return "F.linear with a weight that is not 2-D or a bias that is not 1-D"
    return capture.run(DeferredLinear, "F.linear", None, x, w, b)
