"""nn.Linear with a deferred weight gradient.

I computes ``dX = dY @ W``; W computes ``dW = cat(dY)^T @ cat(X)`` and
``db = sum(cat(dY))``, whatever the leading dimensions of the stashed calls.
Stashes are concatenated only up to :data:`~twobp.engine.stash.CONCAT_ROWS`
rows per product: small micro-batches gain from fewer, larger products (fewer
passes over the gradient), large ones would only pay for the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.engine.deferred import DeferredLayer
from twobp.engine.stash import SharedRows, accumulate_grad, cat_rows, row_chunks


class DeferredLinear(DeferredLayer):
    """Covers ``nn.Linear`` (with or without bias, any leading dimensions)."""

    layer_types = (nn.Linear,)

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight, bias = params
        assert weight is not None
        return F.linear(x, weight, bias), (x, weight), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight = saved
        grad_in = grad_out.matmul(weight) if needs_input_grad else None
        return grad_in, (x, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.weight_parameters()
        assert weight is not None
        out_features, in_features = weight.shape
        for chunk in row_chunks(stashes, in_features):
            x = shared.cat([s[0] for s in chunk], (in_features,))
            dy = cat_rows([s[1] for s in chunk], (out_features,))
            if weight.requires_grad:
                grad = weight.grad
                if grad is None:
                    weight.grad = torch.mm(dy.t(), x)
                else:
                    # In place: saves a temporary and a pass over the gradient.
                    grad.addmm_(dy.t(), x)
            if bias is not None:
                accumulate_grad(bias, dy.sum(0))
