"""``F.conv1d`` / ``conv2d`` / ``conv3d`` with a deferred weight gradient.

I and W both call ``aten.convolution_backward``, I with only the input
gradient requested, W with only the weight (and bias) gradients, over the
stashed inputs and output gradients concatenated along the batch dimension
(one call per distinct shape; float16 stashes one call each, summed in the
float32 gradient, so that the sum does not overflow float16).

``padding="same"`` that needs more on one side than the other (an even
kernel) pads the input with ``F.pad`` first, as ATen does, so that autograd
differentiates the padding and the deferred op sees a symmetric zero padding.
An unbatched input gets its batch dimension around the deferred op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from twobp.engine.capture import Capture, Captured, Kwargs, bind
from twobp.engine.deferred import DeferredOp, held_or_shape, in_input_dtype
from twobp.engine.operand import cast
from twobp.engine.precision import wide
from twobp.engine.stash import SharedRows, cat_rows, group_by_shape

_convolution = torch.ops.aten.convolution.default
_convolution_backward = torch.ops.aten.convolution_backward.default

Geometry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]
"""A convolution's stride, symmetric padding, dilation and groups."""


class DeferredConv(DeferredOp):
    """A convolution of any dimension, padding, groups and dilation; ``options`` is its geometry."""

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype = call[0]
        weight, bias = self.weights(params, dtype)
        stride, padding, dilation, groups = self.options
        xc = cast(x, dtype)
        out = _convolution(
            xc, weight, bias, stride, padding, dilation, False, [0] * len(stride), groups
        )
        return out, (xc, weight), x.dtype

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight = saved
        grad_in = None
        if needs_input_grad:
            grad_in = self._backward(grad_out, x, weight, None, [True, False, False])[0]
            grad_in = in_input_dtype(grad_in, state)
        return grad_in, (x, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.operands
        assert weight is not None
        bias_sizes = None if bias is None else [stashes[0][1].shape[1]]
        mask = self.weight_grad_mask()
        # Float16 results are summed in float32 .grad one micro-batch at a time: a
        # concatenated float16 convolution gradient could overflow where its parts do not.
        groups = [[s] for s in stashes] if wide(stashes[0][0]) else group_by_shape(stashes)
        for group in groups:
            x = cat_rows([s[0] for s in group], group[0][0].shape[1:])
            dy = cat_rows([s[1] for s in group], group[0][1].shape[1:])
            # The weight gradient reads only the weight's shape, in the stashes' dtype.
            w = weight.read(held_or_shape(weight.param), x.dtype)
            _, grad_weight, grad_bias = self._backward(dy, x, w, bias_sizes, mask)
            if mask[1]:
                weight.add_grad(grad_weight)
            if mask[2]:
                assert bias is not None
                bias.add_grad(grad_bias)

    def _backward(
        self,
        grad_out: Tensor,
        x: Tensor,
        weight: Tensor,
        bias_sizes: list[int] | None,
        mask: list[bool],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``aten.convolution_backward`` with this op's geometry; ``mask`` picks the
        input, weight and bias gradients to compute (the others are not defined)."""
        stride, padding, dilation, groups = self.options
        grads: tuple[Tensor, Tensor, Tensor] = _convolution_backward(
            grad_out,
            x,
            weight,
            bias_sizes,
            stride,
            padding,
            dilation,
            False,
            [0] * len(stride),
            groups,
            mask,
        )
        return grads


def _tuple(value: Any, dims: int) -> tuple[int, ...] | None:
    if isinstance(value, int):
        return (value,) * dims
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        if len(value) == dims:
            return tuple(value)
        return tuple(value) * dims if len(value) == 1 else None
    return None


def _same_padding(
    kernel: Sequence[int], dilation: tuple[int, ...]
) -> tuple[tuple[int, ...], list[int] | None]:
    """ATen's split of ``padding="same"``: the symmetric part, and what F.pad adds (or None)."""
    lefts, extra = [], []
    for k, d in zip(kernel, dilation, strict=True):
        total = d * (k - 1)
        lefts.append(total // 2)
        extra.append(total - 2 * (total // 2))
    pad = [p for e in reversed(extra) for p in (0, e)] if any(extra) else None
    return tuple(lefts), pad


_CONV = (("input", "weight", "bias", "stride", "padding", "dilation", "groups"), (None, 1, 0, 1, 1))


def _capture_conv(dims: int, capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    bound = bind(args, kwargs, *_CONV)
    if bound is None:
        return None
    x, weight, bias, stride, padding, dilation, groups = bound
    w = capture.operand(weight)
    if not w or not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        return None
    b = capture.operand(bias)
    name = f"F.conv{dims}d"
    if b is False:
        return f"{name} with a bias that is not a parameter"
    strides, dilations = _tuple(stride, dims), _tuple(dilation, dims)
    if strides is None or dilations is None or not isinstance(groups, int):
        return None
    pre_pad = None
    if padding == "valid":
        paddings: tuple[int, ...] | None = (0,) * dims
    elif padding == "same":
        paddings, pre_pad = _same_padding(weight.shape[2:], dilations)
    else:
        paddings = _tuple(padding, dims)
    if paddings is None:
        return None
    unbatched = x.dim() == dims + 1
    if unbatched:
        x = x.unsqueeze(0)
    if pre_pad is not None:
        x = F.pad(x, pre_pad)
    out = capture.run(DeferredConv, name, (strides, paddings, dilations, groups), x, w, b)
    return out.squeeze(0) if unbatched and isinstance(out, Tensor) else out


def capture_conv1d(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.conv1d`` with a stage parameter as ``weight``."""
    return _capture_conv(1, capture, args, kwargs)


def capture_conv2d(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.conv2d`` with a stage parameter as ``weight``."""
    return _capture_conv(2, capture, args, kwargs)


def capture_conv3d(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.conv3d`` with a stage parameter as ``weight``."""
    return _capture_conv(3, capture, args, kwargs)
