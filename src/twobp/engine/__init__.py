"""The 2-stage backward engine: input gradients now, weight gradients later and concatenated.

``defer_weight_grads(module)`` patches the covered layers of a stage module
and returns its :class:`WeightGradStore`, which runs the input pass (I), the
weight pass (W) over any group of micro-batches, and the full backward (B).
"""

from twobp.engine.phases import TwoStageBackwardError
from twobp.engine.store import WeightGradStore, defer_weight_grads

__all__ = ["TwoStageBackwardError", "WeightGradStore", "defer_weight_grads"]
