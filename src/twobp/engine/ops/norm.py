"""``F.layer_norm``, ``F.group_norm`` and ``F.rms_norm`` with deferred weight gradients.

LayerNorm and GroupNorm use ATen's own kernels: the ``native_*`` forward in F,
then the ``native_*_backward`` with only the input gradient requested in I,
and with only the weight and bias gradients requested in W, once per stashed
call (a reduction over rows gains nothing from concatenating them). The
LayerNorm's are the kernels plain autograd runs, and its output and gradients
are plain autograd's to the bit. Its F calls torch's own binding of the forward
with torch functions disabled (about 1 us less per call than ``torch.ops.aten``,
whose calls parse their arguments against the schema; no torch function mode of
the user's sees the call), and I and W call the backward's operator without its
Python wrapper.

RMSNorm (``y = x_hat * w`` with ``x_hat = x * rstd`` and
``rstd = 1 / sqrt(mean(x^2) + eps)``, computed in float32 for half inputs) is
written out: CPU builds have no fused RMSNorm backward kernel. F keeps
``x_hat``, which both I and W read. F of a float32 or float64 input runs torch's fused
forward kernel (``torch._fused_rms_norm``, where it exists) for the output and ``rstd``:
one kernel instead of five, then ``x_hat = x * rstd``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from twobp.engine.autocast import AutocastRule
from twobp.engine.capture import Capture, Captured, Kwargs, bind
from twobp.engine.deferred import DeferredOp, held_or_shape, in_input_dtype
from twobp.engine.operand import Operand, cast
from twobp.engine.ops.batchnorm import check_values_per_channel
from twobp.engine.stash import SharedRows

_native_layer_norm = torch._C._VariableFunctions.native_layer_norm
"""``(out, mean, rstd)``: torch's binding, faster than ``torch.ops.aten``'s (called with
torch functions disabled, so that no mode sees it)."""
_disabled_torch_function = torch._C.DisableTorchFunction
_layer_norm_backward_op = torch.ops.aten.native_layer_norm_backward.default
_layer_norm_backward: Any = getattr(_layer_norm_backward_op, "_op", _layer_norm_backward_op)
"""The backward's operator without the Python ``__call__`` of its overload (0.3 us a call)."""
_group_norm = torch.ops.aten.native_group_norm.default
_group_norm_backward = torch.ops.aten.native_group_norm_backward.default


def _affine_as_in_forward(operand: Operand | None, x: Tensor) -> Tensor | None:
    """A norm's weight or bias as F read it, given the stashed input ``x``.

    F cast it to float32 only where autocast ran the norm in float32, and then
    ``x`` is float32 too.
    """
    if operand is None:
        return None
    param = held_or_shape(operand.param)
    return operand.read(param, torch.float32 if x.dtype == torch.float32 else None)


class DeferredLayerNorm(DeferredOp):
    """A layer norm with affine weight and/or bias; ``options`` is ``(normalized_shape, eps)``."""

    autocast_rule = AutocastRule.PROBED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shape = list(self.options[0])
        """``normalized_shape`` as the kernels take it, built once: every call reads it."""

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype) -> Tensor:
        return F.layer_norm(torch.ones(1, 2, dtype=dtype, device=device), (2,))

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype = call[0]
        weight, bias = self.weights(params, dtype)
        xc = cast(x, dtype)
        with _disabled_torch_function():
            out, mean, rstd = _native_layer_norm(xc, self._shape, weight, bias, self.options[1])
        # The bias is not saved: the input gradient does not read it.
        return out, (xc, mean, rstd, weight), x.dtype

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, mean, rstd, weight = saved
        grad_in = None
        if needs_input_grad:
            grad_in = _layer_norm_backward(
                grad_out, x, self._shape, mean, rstd, weight, None, [True, False, False]
            )[0]
            grad_in = in_input_dtype(grad_in, state)
        return grad_in, (x, mean, rstd, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.operands
        mask = self.weight_grad_mask()
        shape = self._shape
        # Where F read the parameters as they are, they are what _affine_as_in_forward
        # would return: passed without its calls.
        params: list[Tensor | None] = [
            None if o is None else held_or_shape(o.param) for o in self.operands
        ]
        dtypes = {p.dtype for p in params if p is not None}
        as_they_are = dtypes.pop() if self.plain and len(dtypes) == 1 else None
        # Reductions over rows: one call per stash, concatenating would only copy.
        for x, mean, rstd, dy in stashes:
            if x.dtype == as_they_are:
                w, b = params
            else:
                w, b = _affine_as_in_forward(weight, x), _affine_as_in_forward(bias, x)
            _, grad_weight, grad_bias = _layer_norm_backward(dy, x, shape, mean, rstd, w, b, mask)
            if mask[1]:
                assert weight is not None
                weight.add_grad(grad_weight)
            if mask[2]:
                assert bias is not None
                bias.add_grad(grad_bias)


class DeferredGroupNorm(DeferredOp):
    """A group norm with an affine weight and/or bias; ``options`` is ``(num_groups, eps)``."""

    autocast_rule = AutocastRule.PROBED

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype) -> Tensor:
        return F.group_norm(torch.ones(1, 2, 2, dtype=dtype, device=device), 1)

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype = call[0]
        weight, bias = self.weights(params, dtype)
        groups, eps = self.options
        xc = cast(x, dtype).contiguous()
        n, c = xc.shape[0], xc.shape[1]
        out, mean, rstd = _group_norm(xc, weight, bias, n, c, math.prod(xc.shape[2:]), groups, eps)
        return out, (xc, mean, rstd, weight), x.dtype

    def _backward(
        self, dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, w: Tensor | None, mask: list[bool]
    ) -> tuple[Tensor, Tensor, Tensor]:
        n, c = x.shape[0], x.shape[1]
        grads: tuple[Tensor, Tensor, Tensor] = _group_norm_backward(
            dy.contiguous(), x, mean, rstd, w, n, c, math.prod(x.shape[2:]), self.options[0], mask
        )
        return grads

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, mean, rstd, weight = saved
        grad_in = None
        if needs_input_grad:
            grad_in = self._backward(grad_out, x, mean, rstd, weight, [True, False, False])[0]
            grad_in = in_input_dtype(grad_in, state)
        return grad_in, (x, mean, rstd, grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.operands
        mask = self.weight_grad_mask()
        for x, mean, rstd, dy in stashes:
            w = _affine_as_in_forward(weight, x)
            _, grad_weight, grad_bias = self._backward(dy, x, mean, rstd, w, mask)
            if mask[1]:
                assert weight is not None
                weight.add_grad(grad_weight)
            if mask[2]:
                assert bias is not None
                bias.add_grad(grad_bias)


_fused_rms_norm: Any = getattr(torch, "_fused_rms_norm", None)
"""``(out, rstd)`` of an RMS norm in one kernel (CPU and CUDA), where this torch has it."""
_FUSED_DTYPES = (torch.float32, torch.float64)
"""The input dtypes F runs through :data:`_fused_rms_norm` (half types compute in float32
and keep the written-out path: its rounding of ``x_hat * w`` is the one I and W assume)."""


def _opmath(x: Tensor) -> Tensor:
    """``x`` in the precision RMSNorm computes in (float32 for half types)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class DeferredRMSNorm(DeferredOp):
    """An RMS norm with an affine weight; ``options`` is ``(normalized_shape, eps)``."""

    autocast_rule = AutocastRule.PROBED

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype) -> Tensor:
        return F.rms_norm(torch.ones(1, 2, dtype=dtype, device=device), (2,))

    def _dims(self) -> tuple[int, ...]:
        return tuple(range(-len(self.options[0]), 0))

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype = call[0]
        weight, _ = self.weights(params, dtype)
        assert weight is not None
        xc = cast(x, dtype)
        eps = self.options[1]
        if _fused_rms_norm is not None and xc.dtype in _FUSED_DTYPES and weight.dtype == xc.dtype:
            # One kernel for the norm and rstd (float32 and float64, computed
            # in the input's dtype as below); x_hat is the one product left.
            out, rstd = _fused_rms_norm(xc, self.options[0], weight, eps)
            return out, (xc * rstd, rstd, weight), (xc.dtype, x.dtype)
        xf = _opmath(xc)
        if eps is None:
            eps = torch.finfo(xf.dtype).eps
        rstd = torch.rsqrt(xf.pow(2).mean(self._dims(), keepdim=True).add_(eps))
        # I and W both need x_hat: keep it instead of x.
        x_hat = xf * rstd
        out = (x_hat * weight).to(xc.dtype)
        return out, (x_hat, rstd, weight), (xc.dtype, x.dtype)

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x_hat, rstd, weight = saved
        compute_dtype, input_dtype = state
        grad_in = None
        if needs_input_grad:
            g = _opmath(grad_out) * weight
            dot = (g * x_hat).mean(self._dims(), keepdim=True)
            grad_in = (rstd * (g - x_hat * dot)).to(input_dtype)
        return grad_in, (x_hat.to(compute_dtype), grad_out)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, _ = self.operands
        assert weight is not None
        if not weight.param.requires_grad:
            return
        shape = self.options[0]
        # A reduction over rows: one product per stash, concatenating would only copy.
        for x_hat, dy in stashes:
            weight.add_grad(torch.mul(_opmath(dy), _opmath(x_hat)).reshape(-1, *shape).sum(0))


class DeferredRMSNormAffine(DeferredRMSNorm):
    """The weight product ``x_hat * w`` of an RMS norm whose normalisation ran elsewhere.

    A compiled graph computes ``x_hat`` in the region before the norm (fused with
    the residual add there, forward and backward, see :mod:`twobp.engine.compiled`)
    and routes only this product to the capture: F multiplies, I is ``dY * w``,
    W the same reduction as :class:`DeferredRMSNorm`'s. ``options`` is
    ``(normalized_shape, "affine")``.
    """

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight, _ = self.weights(params, call[0])
        assert weight is not None
        xc = cast(x, call[0])
        x_hat = _opmath(xc)
        return (x_hat * weight).to(xc.dtype), (x_hat, weight), (xc.dtype, x.dtype)

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x_hat, weight = saved
        compute_dtype, input_dtype = state
        grad_in = None
        if needs_input_grad:
            grad_in = (_opmath(grad_out) * weight).to(input_dtype)
        return grad_in, (x_hat.to(compute_dtype), grad_out)


def rms_norm_affine(x_hat: Tensor, normalized_shape: Sequence[int], weight: Tensor) -> Tensor:
    """``x_hat * weight``: the affine part of ``F.rms_norm`` given the normalised input.

    What a compiled graph calls where it unfolded an RMS norm; through a store's
    capture the weight gradient is deferred (:class:`DeferredRMSNormAffine`).
    """
    return x_hat * weight


def normalized_shape_of(value: Any) -> tuple[int, ...] | None:
    """A norm's ``normalized_shape`` argument as a tuple of ints (None: not one)."""
    if type(value) is tuple and len(value) == 1 and type(value[0]) is int:
        return value  # a module's one normalised dimension: every call of nn.LayerNorm(n)
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (tuple, list, torch.Size)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


_LAYER_NORM = (("input", "normalized_shape", "weight", "bias", "eps"), (None, None, 1e-5))
_GROUP_NORM = (("input", "num_groups", "weight", "bias", "eps"), (None, None, 1e-5))
RMS_NORM_SIGNATURE = (("input", "normalized_shape", "weight", "eps"), (None, None))
"""``F.rms_norm``'s argument names and the defaults of the last ones (for :func:`bind`)."""
_RMS_NORM_AFFINE = (("x_hat", "normalized_shape", "weight"), ())


def _affine(
    capture: Capture, weight: Any, bias: Any, name: str
) -> tuple[Operand | None, Operand | None] | str | None:
    """The weight and bias operands, a reason to leave the call to autograd, or None."""
    w, b = capture.operand(weight), capture.operand(bias)
    if not w and not b:
        return None
    if w is False or b is False:
        return f"{name} with an affine operand that is not a parameter"
    return w, b


def capture_layer_norm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.layer_norm`` with stage parameters as ``weight`` and/or ``bias``."""
    bound = bind(args, kwargs, *_LAYER_NORM)
    if bound is None:
        return None
    x, normalized_shape, weight, bias, eps = bound
    operands = _affine(capture, weight, bias, "F.layer_norm")
    shape = normalized_shape_of(normalized_shape)
    if not isinstance(operands, tuple):
        return operands
    if shape is None:
        return None
    return capture.run(DeferredLayerNorm, "F.layer_norm", (shape, eps), x, *operands)


def capture_group_norm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.group_norm`` with stage parameters as ``weight`` and/or ``bias``."""
    bound = bind(args, kwargs, *_GROUP_NORM)
    if bound is None:
        return None
    x, groups, weight, bias, eps = bound
    operands = _affine(capture, weight, bias, "F.group_norm")
    if not isinstance(operands, tuple) or not isinstance(x, Tensor) or x.dim() < 2:
        return operands if isinstance(operands, str) else None
    if not isinstance(groups, int) or groups <= 0 or x.shape[1] % groups:
        return None  # F.group_norm raises: let it
    check_values_per_channel([x.shape[0] * x.shape[1] // groups, groups, *x.shape[2:]])
    return capture.run(DeferredGroupNorm, "F.group_norm", (groups, eps), x, *operands)


def capture_rms_norm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.rms_norm`` with a stage parameter as ``weight``."""
    bound = bind(args, kwargs, *RMS_NORM_SIGNATURE)
    if bound is None:
        return None
    x, normalized_shape, weight, eps = bound
    w = capture.operand(weight)
    shape = normalized_shape_of(normalized_shape)
    if not w or shape is None:
        return None
    return capture.run(DeferredRMSNorm, "F.rms_norm", (shape, eps), x, w, None)


def capture_rms_norm_affine(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """:func:`rms_norm_affine` with a stage parameter as ``weight``: reported as ``F.rms_norm``."""
    bound = bind(args, kwargs, *_RMS_NORM_AFFINE)
    if bound is None:
        return None
    x_hat, normalized_shape, weight = bound
    w = capture.operand(weight)
    shape = normalized_shape_of(normalized_shape)
    if not w or shape is None:
        return None
    return capture.run(DeferredRMSNormAffine, "F.rms_norm", (shape, "affine"), x_hat, w, None)
