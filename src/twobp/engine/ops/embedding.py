"""``F.embedding`` with a deferred weight gradient.

The indices need no gradient, so I computes nothing and stashes the indices
and the output gradient; W scatters the stashed rows into the weight gradient
with one ``index_add_`` per stash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from twobp.engine.autocast import AutocastRule
from twobp.engine.capture import Capture, Captured, Kwargs, bind
from twobp.engine.deferred import DeferredOp
from twobp.engine.stash import SharedRows


class DeferredEmbedding(DeferredOp):
    """A dense embedding lookup; ``options`` is its ``padding_idx`` (a row without gradient)."""

    autocast_rule = AutocastRule.UNCHANGED

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight, _ = self.weights(params, None)
        assert weight is not None
        return F.embedding(x, weight, self.options), (x,), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        (indices,) = saved
        return None, (indices, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, _ = self.operands
        assert weight is not None
        if not weight.param.requires_grad:
            return
        dim = stashes[0][1].shape[-1]
        rows_of = stashes[0][1].new_zeros
        padding_idx = self.options
        grad = None
        if not weight.steps and weight.param.grad is not None:
            grad = weight.param.grad  # scatter straight into .grad
        if grad is None or grad.dtype != stashes[0][1].dtype:
            grad = rows_of(weight.read(weight.param, None).shape)
        # A scatter of rows: one call per stash, concatenating would only copy.
        for indices, grad_out in stashes:
            flat = indices.reshape(-1)
            rows = grad_out.reshape(-1, dim)
            if padding_idx is not None:
                rows = rows.masked_fill((flat == padding_idx).unsqueeze(1), 0)
            grad.index_add_(0, flat, rows)
        if grad is not weight.param.grad:
            weight.add_grad(grad)


_EMBEDDING = (
    ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
    (None, None, 2.0, False, False),
)


def capture_embedding(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.embedding`` with a stage parameter as ``weight``."""
    bound = bind(args, kwargs, *_EMBEDDING)
    if bound is None:
        return None
    indices, weight, padding_idx, max_norm, _, scale_grad_by_freq, sparse = bound
    w = capture.operand(weight)
    if not w or not isinstance(weight, Tensor):
        return None
    if max_norm is not None:
        return "F.embedding with max_norm: it renormalises the weight in place during forward"
    if scale_grad_by_freq:
        return "F.embedding with scale_grad_by_freq: it scales by per-batch index counts"
    if sparse:
        return "F.embedding with sparse=True: its gradient is sparse"
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return capture.run(DeferredEmbedding, "F.embedding", padding_idx, indices, w, None)
