"""nn.Conv1d / Conv2d / Conv3d with a deferred weight gradient.

I and W both call ``aten.convolution_backward``, I with only the input
gradient requested, W with only the weight (and bias) gradients, over the
stashed inputs and output gradients concatenated along the batch dimension
(one call per distinct shape).

Padding that is not a plain symmetric zero padding (``padding_mode`` other
than ``'zeros'``, ``padding='same'`` with an even kernel) is applied with
``F.pad`` before the deferred operation, exactly as the module's own forward
does, so autograd differentiates the padding and the deferred op sees a
symmetric zero padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.engine.deferred import DeferredLayer, StashSink
from twobp.engine.stash import SharedRows, accumulate_grad, cat_rows, group_by_shape

_convolution = torch.ops.aten.convolution.default
_convolution_backward = torch.ops.aten.convolution_backward.default


class DeferredConv(DeferredLayer):
    """Covers ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (any padding, groups, dilation)."""

    layer_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def __init__(self, index: int, name: str, module: nn.Module, sink: StashSink) -> None:
        super().__init__(index, name, module, sink)
        conv: nn.modules.conv._ConvNd = module  # type: ignore[assignment]
        self._dims = len(conv.kernel_size)
        # What F.pad must add before the deferred op, and the symmetric zero
        # padding the op itself applies.
        self._pre_pad: list[int] | None = None
        self._pad_mode = "constant"
        self._padding: list[int]
        if conv.padding_mode != "zeros":
            self._pre_pad = list(conv._reversed_padding_repeated_twice)
            self._pad_mode = conv.padding_mode
            self._padding = [0] * self._dims
        elif isinstance(conv.padding, str):
            # Same split as nn.Conv: the odd element of 'same' padding goes right.
            reversed_pads = list(conv._reversed_padding_repeated_twice)
            lefts = reversed_pads[0::2][::-1]
            rights = reversed_pads[1::2][::-1]
            self._padding = lefts
            extra = [r - left for left, r in zip(lefts, rights, strict=True)]
            if any(extra):
                self._pre_pad = [p for e in reversed(extra) for p in (0, e)]
        else:
            self._padding = list(conv.padding)

    def _geometry(self) -> tuple[list[int], list[int], list[int], list[int], int]:
        conv: nn.modules.conv._ConvNd = self.module  # type: ignore[assignment]
        return (
            list(conv.stride),
            self._padding,
            list(conv.dilation),
            [0] * self._dims,
            conv.groups,
        )

    def run(self, mb: int, x: Tensor, params: tuple[Tensor | None, ...]) -> Tensor:
        unbatched = x.dim() == self._dims + 1
        if unbatched:
            x = x.unsqueeze(0)
        if self._pre_pad is not None:
            x = F.pad(x, self._pre_pad, mode=self._pad_mode)
        out = self.apply(mb, None, x, params)
        return out.squeeze(0) if unbatched else out

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight, bias = params
        stride, padding, dilation, output_padding, groups = self._geometry()
        out = _convolution(
            x, weight, bias, stride, padding, dilation, False, output_padding, groups
        )
        return out, (x, weight), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight = saved
        grad_in = None
        if needs_input_grad:
            grad_in = self._backward(grad_out, x, weight, None, [True, False, False])[0]
        return grad_in, (x, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.weight_parameters()
        assert weight is not None
        bias_sizes = None if bias is None else list(bias.shape)
        mask = [False, weight.requires_grad, bias is not None and bias.requires_grad]
        for group in group_by_shape(stashes):
            x = cat_rows([s[0] for s in group], group[0][0].shape[1:])
            dy = cat_rows([s[1] for s in group], group[0][1].shape[1:])
            _, grad_weight, grad_bias = self._backward(dy, x, weight, bias_sizes, mask)
            if mask[1]:
                accumulate_grad(weight, grad_weight)
            if mask[2]:
                accumulate_grad(bias, grad_bias)

    def _backward(
        self,
        grad_out: Tensor,
        x: Tensor,
        weight: Tensor,
        bias_sizes: list[int] | None,
        mask: list[bool],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``aten.convolution_backward`` with this layer's geometry; ``mask`` picks
        the input, weight and bias gradients to compute (the others are not defined)."""
        stride, padding, dilation, output_padding, groups = self._geometry()
        grads: tuple[Tensor, Tensor, Tensor] = _convolution_backward(
            grad_out,
            x,
            weight,
            bias_sizes,
            stride,
            padding,
            dilation,
            False,
            output_padding,
            groups,
            mask,
        )
        return grads
