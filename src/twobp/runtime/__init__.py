"""The distributed runtime: run any schedule on ``torch.distributed``.

:class:`Pipeline` splits a model into stages over the ranks of a process
group and runs a schedule's actions on each rank; :func:`launch` starts a
local process group for it (a small ``torchrun``).

Its parts, one folder each, from the bottom up (a folder imports only those
below it):

* ``base/``: what every layer shares: the process group a pipeline runs in
  (``Membership``), the topology (which process runs each stage) and the
  runtime's one piece of module state;
* ``communication/``: the step's point-to-point channel, the collectives and
  the ranks' agreement;
* ``execution/``: one step of one rank: the dispatcher over the lowered
  schedule, the stages and their two-stage backward;
* ``state/``: the model's parameters, gradient norm and checkpoints;
* ``setup/``: building a pipeline: the plan (schedule and blocks per stage),
  ``schedule="auto"`` (``setup/auto/``), the check that ranks hold the same
  model, the replicas and their reduction groups.
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
from twobp.runtime.state.grad_scaler import GradScaler

__all__ = [
    "CheckpointError",
    "GradScaler",
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
