"""nn.LayerNorm and nn.RMSNorm with deferred weight gradients.

LayerNorm uses ATen's own kernels: ``native_layer_norm`` in F, then
``native_layer_norm_backward`` with only the input gradient requested in I,
and with only the weight and bias gradients requested in W, over the stashed
inputs, statistics and output gradients of all calls concatenated.

RMSNorm (``y = x * rstd * w`` with ``rstd = 1 / sqrt(mean(x^2) + eps)``) is
written out: CPU builds have no fused RMSNorm backward kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from twobp.engine.deferred import DeferredLayer
from twobp.engine.stash import accumulate_grad, cat_rows

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

    def accumulate_weight_grads(self, stashes: Sequence[tuple[Tensor, ...]]) -> None:
        weight, bias = self.weight_parameters()
        shape = list(self.module.normalized_shape)  # type: ignore[arg-type]
        ones = [1] * len(shape)
        x = cat_rows([s[0] for s in stashes], shape)
        mean = cat_rows([s[1] for s in stashes], ones)
        rstd = cat_rows([s[2] for s in stashes], ones)
        dy = cat_rows([s[3] for s in stashes], shape)
        mask = [False, weight is not None and weight.requires_grad]
        mask.append(bias is not None and bias.requires_grad)
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
        out = (xf * rstd).type_as(x) * weight
        return out, (x, rstd, weight), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, rstd, weight = saved
        grad_in = None
        if needs_input_grad:
            g = _opmath(grad_out * weight)
            x_hat = _opmath(x) * rstd
            dot = (g * x_hat).mean(self._dims(), keepdim=True)
            grad_in = (rstd * (g - x_hat * dot)).type_as(x)
        return grad_in, (x, rstd, grad_out)

    def accumulate_weight_grads(self, stashes: Sequence[tuple[Tensor, ...]]) -> None:
        (weight,) = self.weight_parameters()
        assert weight is not None
        shape = list(weight.shape)
        x = cat_rows([s[0] for s in stashes], shape)
        rstd = cat_rows([s[1] for s in stashes], [1] * len(shape))
        dy = cat_rows([s[2] for s in stashes], shape)
        x_hat = (_opmath(x) * rstd).type_as(x)
        accumulate_grad(weight, (dy * x_hat).sum(0).to(weight.dtype))
