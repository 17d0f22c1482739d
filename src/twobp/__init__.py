"""twobp: pipeline-parallel training with 2-stage backpropagation (2BP).

The runtime names (``Pipeline``, ``launch`` and the errors) load on first use,
so that ``twobp --help`` and the pure schedule tools do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from twobp.cut import ModelBlocks, SplitError, split
    from twobp.engine import TwoStageBackwardError, WeightGradStore, defer_weight_grads
    from twobp.runtime import (
        CheckpointError,
        GradScaler,
        LaunchError,
        ModelMismatchError,
        NonFiniteLossError,
        NonRepeatableForwardError,
        PeerError,
        PeerFailedError,
        PeerStepFailedError,
        PeerTimeoutError,
        Pipeline,
        PipelineClosedError,
        PipelineConfigError,
        PipelineError,
        PipelineOptions,
        RankFailure,
        ShapeMismatchError,
        launch,
    )

_LAZY = {
    "split": "twobp.cut",
    "SplitError": "twobp.cut",
    "ModelBlocks": "twobp.cut",
    "GradScaler": "twobp.runtime",
    "LaunchError": "twobp.runtime",
    "NonFiniteLossError": "twobp.runtime",
    "NonRepeatableForwardError": "twobp.runtime",
    "ModelMismatchError": "twobp.runtime",
    "CheckpointError": "twobp.runtime",
    "PeerError": "twobp.runtime",
    "PeerFailedError": "twobp.runtime",
    "PeerStepFailedError": "twobp.runtime",
    "PeerTimeoutError": "twobp.runtime",
    "Pipeline": "twobp.runtime",
    "PipelineClosedError": "twobp.runtime",
    "PipelineConfigError": "twobp.runtime",
    "PipelineError": "twobp.runtime",
    "PipelineOptions": "twobp.runtime",
    "RankFailure": "twobp.runtime",
    "ShapeMismatchError": "twobp.runtime",
    "launch": "twobp.runtime",
    "defer_weight_grads": "twobp.engine",
    "WeightGradStore": "twobp.engine",
    "TwoStageBackwardError": "twobp.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'twobp' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "GradScaler",
    "LaunchError",
    "ModelBlocks",
    "ModelMismatchError",
    "NonFiniteLossError",
    "NonRepeatableForwardError",
    "PeerError",
    "PeerFailedError",
    "PeerStepFailedError",
    "PeerTimeoutError",
    "Pipeline",
    "PipelineClosedError",
    "PipelineConfigError",
    "PipelineError",
    "PipelineOptions",
    "RankFailure",
    "ShapeMismatchError",
    "SplitError",
    "TwoStageBackwardError",
    "WeightGradStore",
    "__version__",
    "defer_weight_grads",
    "launch",
    "split",
]
