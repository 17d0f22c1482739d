"""The 2-stage backward engine: input gradients now, weight gradients later and concatenated.

``defer_weight_grads(module)`` returns the :class:`WeightGradStore` of a stage
module. In its forwards every covered operation (``F.linear``, ``addmm``,
``matmul``, convolutions, ``F.embedding``, norms) whose weight operand is a
parameter of the module defers its weight gradient, whoever calls it and under
``torch.autocast`` too; the store runs the input pass (I), the weight pass (W)
over any group of micro-batches, and the full backward (B).
"""

from twobp.engine.phases import TwoStageBackwardError
from twobp.engine.store import WeightGradStore, defer_weight_grads

__all__ = ["TwoStageBackwardError", "WeightGradStore", "defer_weight_grads"]
