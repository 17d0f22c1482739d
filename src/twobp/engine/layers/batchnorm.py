"""nn.BatchNorm1d / 2d / 3d with deferred affine-parameter gradients.

In training mode the input gradient needs the per-channel sums ``sum(dY)``
and ``sum(dY * x_hat)``, which are exactly the bias and weight gradients, so
I asks ``native_batch_norm_backward`` for all three and stashes the two small
per-channel vectors; W adds up the vectors of all stashed calls. In eval mode
the same call costs one extra reduction in I. Either way the stash is tiny.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from twobp.engine.deferred import DeferredLayer
from twobp.engine.stash import SharedRows, accumulate_grad

_batch_norm = torch.ops.aten.native_batch_norm.default
_batch_norm_backward = torch.ops.aten.native_batch_norm_backward.default


class DeferredBatchNorm(DeferredLayer):
    """Covers ``nn.BatchNorm1d/2d/3d`` with ``affine=True``, training and eval mode."""

    layer_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

    def run(self, mb: int, x: Tensor, params: tuple[Tensor | None, ...]) -> Tensor:
        # The bookkeeping of nn.modules.batchnorm._BatchNorm.forward, unchanged.
        bn: nn.modules.batchnorm._BatchNorm = self.module  # type: ignore[assignment]
        bn._check_input_dim(x)  # type: ignore[no-untyped-call]
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        use_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        return self.apply(mb, (use_batch_stats, momentum), x, params)

    def _running_stats(self) -> tuple[Tensor | None, Tensor | None]:
        """The running statistics the op reads or updates, as the module's forward passes them."""
        bn: nn.modules.batchnorm._BatchNorm = self.module  # type: ignore[assignment]
        if bn.training and not bn.track_running_stats:
            return None, None
        return bn.running_mean, bn.running_var

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight, bias = params
        use_batch_stats, momentum = options
        running_mean, running_var = self._running_stats()
        eps = self.module.eps
        out, save_mean, save_invstd = _batch_norm(
            x, weight, bias, running_mean, running_var, use_batch_stats, momentum, eps
        )
        if use_batch_stats:
            # The running statistics change in place at the next forward; the
            # backward of a batch-statistics norm does not read them.
            running_mean = running_var = None
        saved = (x, weight, running_mean, running_var, save_mean, save_invstd)
        return out, saved, use_batch_stats

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight, running_mean, running_var, save_mean, save_invstd = saved
        grad_in, grad_weight, grad_bias = _batch_norm_backward(
            grad_out,
            x,
            weight,
            running_mean,
            running_var,
            save_mean,
            save_invstd,
            state,
            self.module.eps,
            [needs_input_grad, True, True],
        )
        return grad_in, (grad_weight, grad_bias)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight, bias = self.weight_parameters()
        accumulate_grad(weight, _total([s[0] for s in stashes]))
        accumulate_grad(bias, _total([s[1] for s in stashes]))


def _total(vectors: Sequence[Tensor]) -> Tensor:
    """The sum of per-call gradient vectors (one call: the vector itself, no copy)."""
    return vectors[0] if len(vectors) == 1 else torch.stack(list(vectors)).sum(0)
