"""The layer types whose weight gradient the engine defers, one module per family."""

from __future__ import annotations

from torch import nn

from twobp.engine.deferred import DeferredLayer
from twobp.engine.layers.batchnorm import DeferredBatchNorm
from twobp.engine.layers.conv import DeferredConv
from twobp.engine.layers.embedding import DeferredEmbedding
from twobp.engine.layers.linear import DeferredLinear
from twobp.engine.layers.norm import DeferredLayerNorm, DeferredRMSNorm

COVERED_LAYERS: tuple[type[DeferredLayer], ...] = (
    DeferredLinear,
    DeferredConv,
    DeferredEmbedding,
    DeferredLayerNorm,
    DeferredRMSNorm,
    DeferredBatchNorm,
)
"""Every covered layer family, in the order they are tried."""


def deferred_layer_for(module: nn.Module) -> type[DeferredLayer] | None:
    """The class that covers ``module``, or None if its type is not covered.

    A subclass of a covered type is covered only if it keeps the covered
    type's ``forward``: a subclass that overrides it computes something else.
    """
    for deferred in COVERED_LAYERS:
        for layer_type in deferred.layer_types:
            if isinstance(module, layer_type) and type(module).forward is layer_type.forward:
                return deferred
    return None


__all__ = ["COVERED_LAYERS", "deferred_layer_for"]
