"""The 2-stage backward engine: input gradients now, weight gradients later and concatenated.

``defer_weight_grads(module)`` returns the :class:`WeightGradStore` of a stage
module. In its forwards every covered operation (``F.linear``, ``addmm``,
``matmul``, convolutions, ``F.embedding``, norms) whose weight operand is a
parameter of the module defers its weight gradient, whoever calls it and under
``torch.autocast`` too; the store runs the input pass (I), the weight pass (W)
over any group of micro-batches, and the full backward (B).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twobp.engine.phases import TwoStageBackwardError

if TYPE_CHECKING:
    from twobp.engine.store import WeightGradStore, defer_weight_grads


def __getattr__(name: str) -> Any:
    # The store (and torch) load on first use, so that the pure per-micro-batch
    # state machine (twobp.engine.phases) imports no torch.
    if name in ("WeightGradStore", "defer_weight_grads"):
        from twobp.engine import store

        return getattr(store, name)
    raise AttributeError(f"module 'twobp.engine' has no attribute {name!r}")


__all__ = ["TwoStageBackwardError", "WeightGradStore", "defer_weight_grads"]
