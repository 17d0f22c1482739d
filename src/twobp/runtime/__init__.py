"""The distributed runtime: run any schedule on ``torch.distributed``.

:class:`Pipeline` splits a model into stages over the ranks of a process
group and runs a schedule's actions on each rank; :func:`launch` starts a
local process group for it (a small ``torchrun``).

Its parts, one folder each:

* ``setup/``: joining the process group, the topology (which process runs
  each stage), the plan (schedule and blocks per stage), and the ranks'
  agreement on options and model;
* ``execution/``: one step of one rank: the dispatcher over the lowered
  schedule, the stages and their two-stage backward;
* ``communication/``: the step's point-to-point channel and the collectives;
* ``state/``: the model's parameters, gradient norm and checkpoints.
"""

from twobp.runtime.errors import (
    CheckpointError,
    LaunchError,
    ModelMismatchError,
    NonFiniteLossError,
    NonRepeatableForwardError,
    PeerError,
    PeerFailedError,
    PeerStepFailedError,
    PeerTimeoutError,
    PipelineClosedError,
    PipelineConfigError,
    PipelineError,
    RankFailure,
    ShapeMismatchError,
)
from twobp.runtime.launch import launch
from twobp.runtime.options import PipelineOptions
from twobp.runtime.pipeline import Pipeline

__all__ = [
    "CheckpointError",
    "LaunchError",
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
    "launch",
]
