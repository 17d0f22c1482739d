"""A pipeline that plans at its first step: what it keeps until then.

``schedule="auto"`` without an example input (or with ``n_microbatches="auto"``,
or ``recompute="auto"`` without one) plans on the first step's batch. Until
then :class:`twobp.runtime.Pipeline` holds a :class:`Pending`: the blocks,
the loss and what planning takes (:class:`Given`); its ``parameters()`` are
every block's, each once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from twobp.runtime.base.group import Membership
from twobp.runtime.communication.agreement import agree
from twobp.runtime.execution.microbatch import Batch, flatten, unflatten
from twobp.runtime.execution.stage import LossFn
from twobp.runtime.options import AUTO, AUTO_MICROBATCHES, PipelineOptions
from twobp.runtime.state.model_names import ModelNames
from twobp.schedule import SCHEDULES

T = TypeVar("T")


@dataclass(frozen=True)
class Given:
    """What planning takes: the options, and the live resources the pipeline does not keep
    once planned (the example input, the process group or mesh the trials are built on)."""

    options: PipelineOptions
    example_input: Batch | None
    group: dist.ProcessGroup | None
    mesh: Any


@dataclass(frozen=True)
class Pending:
    """What a pipeline that plans at its first step builds its stages from then."""

    blocks: list[nn.Module]
    names: Any
    loss_fn: LossFn
    given: Given
    members: Membership
    grid: list[list[int]]

    @property
    def model(self) -> nn.Sequential:
        """Every block, as ``nn.Sequential(*blocks)`` names them (a tied weight once)."""
        return nn.Sequential(OrderedDict((str(i), b) for i, b in enumerate(self.blocks)))

    def named(self, named: Iterator[tuple[str, T]], prefix: str) -> Iterator[tuple[str, T]]:
        """``named`` (block names) in the names the planned pipeline will give."""
        if self.names is None:
            return ((prefix + n, t) for n, t in named)
        return ((prefix + n, t) for n, t in ModelNames(self.names).named(named))


def plans_at_first_step(
    given: Given, members: Membership, device: torch.device, timeout: float
) -> bool:
    """True if ``schedule="auto"`` plans on the first step's batch: with
    ``n_microbatches="auto"``, or where no rank was given an example input and
    nothing else is to plan by (collective where it depends on the example input)."""
    options = given.options
    planned = isinstance(options.schedule, str) and (
        options.schedule == AUTO or (options.rebuilds and options.schedule in SCHEDULES)
    )
    if not planned or options.costs is not None:
        return False
    if options.n_microbatches == AUTO_MICROBATCHES:
        return True
    # Alike on every rank: if any has an example input, all plan now (and those without
    # one are refused there, naming what they lack).
    table = agree(
        members, device, timeout, None, "building the pipeline", [given.example_input is not None]
    )
    return not any(row[0] for row in table)


def detached(batch: Batch) -> Batch:
    """``batch`` without autograd history (planning keeps a copy of it)."""
    tensors, is_tuple = flatten(batch)
    return unflatten([t.detach() for t in tensors], is_tuple)
