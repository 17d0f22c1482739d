"""nn.LayerNorm and nn.RMSNorm with deferred weight gradients.

LayerNorm uses ATen's own kernels: ``native_layer_norm`` in F, then
``native_layer_norm_backward`` with only the input gradient requested in I,
and with only the weight and bias gradients requested in W, once per stashed
call (a reduction over rows gains nothing from concatenating them).

RMSNorm (``y = x_hat * w`` with ``x_hat = x * rstd`` and
``rstd = 1 / sqrt(mean(x^2) + eps)``) is written out: CPU builds have no fused
RMSNorm backward kernel. F keeps ``x_hat``, which both I and W read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from twobp.engine.deferred import DeferredLayer
from twobp.engine.stash import SharedRows, accumulate_grad

_layer_norm = torch.ops.aten.native_layer_norm.default
_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default


class DeferredLayerNorm(DeferredLayer):
    """Covers ``nn.LayerNorm`` with an affine weight and/or bias."""

    layer_types = (nn.LayerNorm,)

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight, bias = params
        norm: nn.LayerNorm = self.module  # type: ignore[assignment]
        out, mean, rstd = _layer_norm(x, list(norm.normalized_shape), weight, bias, norm.eps)
        return out, (x, mean, rstd, weight, bias), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, mean, rstd, weight, bias = saved
        grad_in = None
        if needs_input_grad:
            shape = list(self.module.normalized_shape)  # type: ignore[arg-type]
            grad_in = _layer_norm_backward(
                grad_out, x, shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        return grad_in, (x, mean, rstd, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.weight_parameters()
        shape = list(self.module.normalized_shape)  # type: ignore[arg-type]
        mask = [False, weight is not None and weight.requires_grad]
        mask.append(bias is not None and bias.requires_grad)
        # Reductions over rows: one call per stash, concatenating would only copy.
        for x, mean, rstd, dy in stashes:
            _, grad_weight, grad_bias = _layer_norm_backward(
                dy, x, shape, mean, rstd, weight, bias, mask
            )
            if mask[1]:
                accumulate_grad(weight, grad_weight)
            if mask[2]:
                accumulate_grad(bias, grad_bias)


def _opmath(x: Tensor) -> Tensor:
    """``x`` in the precision RMSNorm computes in (float32 for half types)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class DeferredRMSNorm(DeferredLayer):
    """Covers ``nn.RMSNorm`` with an affine weight."""

    layer_types = (nn.RMSNorm,)
    parameter_names = ("weight",)

    def _dims(self) -> tuple[int, ...]:
        return tuple(range(-len(self.module.normalized_shape), 0))  # type: ignore[arg-type]

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        (weight,) = params
        assert weight is not None
        norm: nn.RMSNorm = self.module  # type: ignore[assignment]
        eps = norm.eps
        xf = _opmath(x)
        if eps is None:
            eps = torch.finfo(xf.dtype).eps
        rstd = torch.rsqrt(xf.pow(2).mean(self._dims(), keepdim=True).add_(eps))
        # I and W both need x_hat: keep it instead of x.
        x_hat = xf * rstd
        out = x_hat.type_as(x) * weight
        return out, (x_hat, rstd, weight), x.dtype

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x_hat, rstd, weight = saved
        grad_in = None
        if needs_input_grad:
            g = _opmath(grad_out * weight)
            dot = (g * x_hat).mean(self._dims(), keepdim=True)
            grad_in = (rstd * (g - x_hat * dot)).to(state)
        return grad_in, (x_hat.to(state), grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        (weight,) = self.weight_parameters()
        assert weight is not None
        if not weight.requires_grad:
            return
        shape = weight.shape
        # A reduction over rows: one product per stash, concatenating would only copy.
        for x_hat, dy in stashes:
            grad = torch.mul(dy, x_hat).reshape(-1, *shape).sum(0)
            accumulate_grad(weight, grad.to(weight.dtype))
