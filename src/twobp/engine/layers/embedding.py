"""nn.Embedding with a deferred weight gradient.

The indices need no gradient, so I computes nothing and stashes the indices
and the output gradient; W scatters the stashed rows into the weight gradient
with one ``index_add_`` per stash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.engine.deferred import DeferredLayer
from twobp.engine.stash import SharedRows


class DeferredEmbedding(DeferredLayer):
    """Covers ``nn.Embedding`` with dense gradients (``padding_idx`` respected)."""

    layer_types = (nn.Embedding,)
    parameter_names = ("weight",)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        emb: nn.Embedding = module  # type: ignore[assignment]
        if emb.max_norm is not None:
            return "max_norm renormalises the weight in place during forward"
        if emb.scale_grad_by_freq:
            return "scale_grad_by_freq scales by per-batch index counts"
        if emb.sparse:
            return "sparse=True produces sparse gradients"
        return None

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        (weight,) = params
        assert weight is not None
        emb: nn.Embedding = self.module  # type: ignore[assignment]
        return F.embedding(x, weight, emb.padding_idx), (x,), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        (indices,) = saved
        return None, (indices, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        (weight,) = self.weight_parameters()
        assert weight is not None
        if not weight.requires_grad:
            return
        emb: nn.Embedding = self.module  # type: ignore[assignment]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        # A scatter of rows: one call per stash, concatenating would only copy.
        for indices, grad_out in stashes:
            flat = indices.reshape(-1)
            rows = grad_out.reshape(-1, *weight.shape[1:])
            if emb.padding_idx is not None:
                rows = rows.masked_fill((flat == emb.padding_idx).unsqueeze(1), 0)
            weight.grad.index_add_(0, flat, rows)
