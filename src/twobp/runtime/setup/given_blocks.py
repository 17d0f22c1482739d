"""What ``Pipeline`` takes as the model: a list of blocks, checked before any other work."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from twobp.runtime.errors import PipelineConfigError


def as_blocks(blocks: object) -> list[nn.Module]:
    """The blocks of ``blocks`` (an ``nn.Sequential``, an ``nn.ModuleList`` or a list of modules).

    Raises:
        PipelineConfigError: for a whole model (any other ``nn.Module``), something
            that is not a sequence of modules, or no blocks; the message says what
            to pass instead.
    """
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise PipelineConfigError(
            f"Pipeline takes the model as a list of blocks; for a whole model use "
            f"`twobp.split(model)` (got a {type(blocks).__name__}: "
            f"twobp.Pipeline(twobp.split(model), loss_fn, ...))"
        )
    if not isinstance(blocks, (Sequence, nn.Sequential, nn.ModuleList)):
        raise PipelineConfigError(
            f"Pipeline takes the model as a list of blocks (nn.Module each); got a "
            f"{type(blocks).__name__}; for a whole model use `twobp.split(model)`"
        )
    given = list(blocks)
    if not given:
        raise PipelineConfigError("Pipeline got no blocks; pass the model as a list of blocks")
    wrong = [(i, type(b).__name__) for i, b in enumerate(given) if not isinstance(b, nn.Module)]
    if wrong:
        i, kind = wrong[0]
        raise PipelineConfigError(
            f"Pipeline takes a list of blocks, each an nn.Module; block {i} is a {kind}"
        )
    return given
