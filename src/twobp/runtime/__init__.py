"""The distributed runtime: run any schedule on ``torch.distributed``.

:class:`Pipeline` splits a model into stages over the ranks of a process
group and runs a schedule's actions on each rank; :func:`launch` starts a
local process group for it (a small ``torchrun``).
"""

from twobp.runtime.errors import (
    CheckpointError,
    LaunchError,
    ModelMismatchError,
    NonFiniteLossError,
    PeerError,
    PeerFailedError,
    PeerTimeoutError,
    PipelineClosedError,
    PipelineConfigError,
    PipelineError,
    RankFailure,
    ShapeMismatchError,
)
from twobp.runtime.launch import launch
from twobp.runtime.pipeline import Pipeline

__all__ = [
    "CheckpointError",
    "LaunchError",
    "ModelMismatchError",
    "NonFiniteLossError",
    "PeerError",
    "PeerFailedError",
    "PeerTimeoutError",
    "Pipeline",
    "PipelineClosedError",
    "PipelineConfigError",
    "PipelineError",
    "RankFailure",
    "ShapeMismatchError",
    "launch",
]
