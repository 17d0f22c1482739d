"""``F.batch_norm`` with deferred affine-parameter gradients.

In training mode the input gradient needs the per-channel sums ``sum(dY)``
and ``sum(dY * x_hat)``, which are exactly the bias and weight gradients, so
I asks ``native_batch_norm_backward`` for all three and stashes the two small
per-channel vectors; W adds up the vectors of all stashed calls. In eval mode
the same call costs one extra reduction in I. Either way the stash is tiny.

``nn.BatchNorm``'s own bookkeeping (counting batches, the momentum of a
cumulative average) happens in its ``forward`` before it calls
``F.batch_norm``, so it is unchanged.
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
from twobp.engine.deferred import DeferredOp, in_input_dtype
from twobp.engine.operand import cast
from twobp.engine.stash import SharedRows

_batch_norm = torch.ops.aten.native_batch_norm.default
_batch_norm_backward = torch.ops.aten.native_batch_norm_backward.default


class DeferredBatchNorm(DeferredOp):
    """A batch norm with an affine weight and/or bias, training or eval; ``options`` is ``eps``.

    The call's ``extra`` is ``(running_mean, running_var, training, momentum)``.
    """

    autocast_rule = AutocastRule.PROBED

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype) -> Tensor:
        return F.batch_norm(torch.ones(2, 2, dtype=dtype, device=device), None, None, training=True)

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        dtype, (running_mean, running_var, training, momentum) = call
        weight, bias = self.weights(params, dtype)
        xc = cast(x, dtype)
        out, save_mean, save_invstd = _batch_norm(
            xc, weight, bias, running_mean, running_var, training, momentum, self.options
        )
        if training:
            # The running statistics change in place at the next forward; the
            # backward of a batch-statistics norm does not read them.
            running_mean = running_var = None
        saved = (xc, weight, running_mean, running_var, save_mean, save_invstd)
        return out, saved, (training, x.dtype)

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight, running_mean, running_var, save_mean, save_invstd = saved
        training, input_dtype = state
        grad_in, grad_weight, grad_bias = _batch_norm_backward(
            grad_out,
            x,
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            training,
            self.options,
            [needs_input_grad, True, True],
        )
        if grad_in is not None:
            grad_in = in_input_dtype(grad_in, input_dtype)
        return grad_in, (grad_weight, grad_bias)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.operands
        if weight is not None:
            weight.add_grad(_total([s[0] for s in stashes]))
        if bias is not None:
            bias.add_grad(_total([s[1] for s in stashes]))


def check_values_per_channel(size: list[int]) -> None:
    """What ``F.batch_norm`` checks in training: more than one value per channel.

    Raises:
        ValueError: if ``size`` (batch, channels, spatial...) has one value per channel.
    """
    if math.prod([size[0], *size[2:]]) == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {size}"
        )


def _total(vectors: Sequence[Tensor]) -> Tensor:
    """The sum of per-call gradient vectors (one call: the vector itself, no copy)."""
    return vectors[0] if len(vectors) == 1 else torch.stack(list(vectors)).sum(0)


_BATCH_NORM = (
    ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    (None, None, False, 0.1, 1e-5),
)


def capture_batch_norm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``F.batch_norm`` with stage parameters as ``weight`` and/or ``bias``."""
    bound = bind(args, kwargs, *_BATCH_NORM)
    if bound is None:
        return None
    x, running_mean, running_var, weight, bias, training, momentum, eps = bound
    w, b = capture.operand(weight), capture.operand(bias)
    if not w and not b:
        return None
    if w is False or b is False or not isinstance(x, Tensor):
        return "F.batch_norm with an affine operand that is not a parameter"
    if training:
        check_values_per_channel(list(x.shape))
    extra = (running_mean, running_var, bool(training), momentum)
    return capture.run(DeferredBatchNorm, "F.batch_norm", eps, x, w, b, extra)
