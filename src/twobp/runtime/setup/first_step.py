"""A pipeline that plans at its first step: what it keeps until then.

``schedule="auto"`` without an example input (or with ``n_microbatches="auto"``,
or ``recompute="auto"`` without one) plans on the first step's batch, and so
does a schedule that puts the model's ends on one rank (a V; Chimera or DualPipe
on more than two ranks) given no partition and no example input: it balances
its stages on the first micro-batch of that batch (:func:`ends_to_balance`). Until
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
from twobp.runtime.base.topology import Topology
from twobp.runtime.communication import collective
from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import Batch, flatten, to_device, unflatten
from twobp.runtime.execution.stage import LossFn
from twobp.runtime.options import AUTO, AUTO_MICROBATCHES, PipelineOptions
from twobp.runtime.setup.auto.plan import AutoPlan
from twobp.runtime.setup.given_blocks import as_blocks
from twobp.runtime.state.model_names import ModelNames, model_names_of
from twobp.schedule import SCHEDULES, Schedule, ScheduleConfigError, ScheduleError
from twobp.schedule.prepare import source_schedule

T = TypeVar("T")


@dataclass(frozen=True)
class Given:
    """What planning takes: the options, and the live resources the pipeline does not keep
    once planned (the example input, the process group or mesh the trials are built on)."""

    options: PipelineOptions
    example_input: Batch | None
    group: dist.ProcessGroup | None
    mesh: Any
    decided: AutoPlan | None = None
    """The plan ``schedule="auto"`` chose over a range of tensor-parallel sizes, which the
    pipeline runs as it is; None otherwise."""


@dataclass(frozen=True)
class Pending:
    """What a pipeline that plans at its first step builds its stages from then."""

    blocks: list[nn.Module]
    names: Any
    loss_fn: LossFn
    given: Given
    members: Membership
    grid: list[list[int]]
    layout: Schedule | None = None
    """The schedule's stages and ranks where they are known before planning (a schedule
    that balances at its first step, :func:`ends_to_balance`): which ranks need the
    inputs and the targets; None otherwise."""

    @classmethod
    def of(
        cls, blocks: Any, loss_fn: LossFn, given: Given, members: Membership, grid: list[list[int]]
    ) -> Pending:
        """What a pipeline built on ``blocks`` (a list of modules or an
        ``nn.Sequential``) plans from; with the layout of a schedule it balances at its
        first step."""
        layout = ends_to_balance(given.options, len(grid[0]))
        return cls(as_blocks(blocks), model_names_of(blocks), loss_fn, given, members, grid, layout)

    def placed(self) -> tuple[Schedule, list[int]] | None:
        """The layout's schedule and this rank's stages in it, where they are known before
        planning (a schedule balanced at its first step); None otherwise."""
        if self.layout is None:
            return None
        pp_rank = Topology.replicated(self.members, self.layout, self.grid).pp_rank
        return self.layout, list(self.layout.stages_of(pp_rank))

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
    given: Given, members: Membership, device: torch.device, timeout: float, n_ranks: int
) -> bool:
    """True if the pipeline plans on the first step's batch: ``schedule="auto"`` with
    ``n_microbatches="auto"``; or ``schedule="auto"``, ``recompute="auto"`` or a
    schedule whose ends share a rank to balance (:func:`ends_to_balance`) where no rank was
    given an example input and nothing else is to plan by (collective where it
    depends on the example input). ``n_ranks``: ranks of one copy of the pipeline."""
    options = given.options
    if given.decided is not None:
        return False
    planned = isinstance(options.schedule, str) and (
        options.schedule == AUTO or (options.rebuilds and options.schedule in SCHEDULES)
    )
    if not (planned or ends_to_balance(options, n_ranks)) or options.costs is not None:
        return False
    if planned and options.n_microbatches == AUTO_MICROBATCHES:
        return True
    # Alike on every rank: if any has an example input, all plan now (and those without
    # one are refused there, naming what they lack).
    table = agree(
        members, device, timeout, None, "building the pipeline", [given.example_input is not None]
    )
    return not any(row[0] for row in table)


def ends_to_balance(options: PipelineOptions, n_ranks: int) -> Schedule | None:
    """The schedule, without communication, that the pipeline balances on the first
    step's first micro-batch when no example input was given: one that puts the model's
    first stage and its last on one rank (:attr:`Schedule.ends_share_a_rank`: a V, or
    Chimera or DualPipe on more than two ranks; by name or given as a :class:`Schedule`),
    with no partition, no cost model and no tensor parallelism given; None otherwise.

    Cut uniformly, the rank with both ends (an embedding, a head) is loaded unlike the
    others. With an example input the pipeline balances on it while it is built.
    """
    if options.partition is not None or options.costs is not None or n_ranks < 2:
        return None  # on one rank, there is no other rank to share the work with
    if not isinstance(options.tensor_parallel, int | None) or (options.tensor_parallel or 1) > 1:
        return None  # each tensor-parallel pipeline would profile and cut apart
    schedule = options.schedule
    if isinstance(schedule, Schedule):
        return schedule if schedule.ends_share_a_rank else None
    if not (isinstance(schedule, str) and schedule in SCHEDULES):
        return None
    count = options.n_microbatches
    try:
        sourced = source_schedule(
            schedule,
            n_ranks=n_ranks,
            n_microbatches=count if isinstance(count, int) else None,
            stages_per_rank=options.stages_per_rank,
        )
    except (ScheduleConfigError, ScheduleError):
        return None  # building the pipeline names what does not fit
    return sourced if sourced.ends_share_a_rank else None


def first_batch(pending: Pending, inputs: Batch | None, rank: int, timeout: float) -> Batch:
    """Rank 0's ``inputs`` (on the CPU, without history), on every rank. Collective.

    Raises:
        PipelineConfigError: on every rank, if rank 0 has none.
    """
    sample: Any = None
    if pending.members.rank == 0:
        sample = (
            "rank 0 was given no inputs"
            if inputs is None
            else to_device(detached(inputs), torch.device("cpu"))
        )
    sample = collective.all_gather_objects(pending.members, sample, timeout)[0]
    if isinstance(sample, str):
        raise PipelineConfigError(
            f"rank {rank}: this pipeline plans on the first step's batch of inputs, but "
            f"{sample}: pass the batch on rank 0, or give example_input= when building the "
            "pipeline"
        )
    batch: Batch = sample
    return batch


def detached(batch: Batch) -> Batch:
    """``batch`` without autograd history (planning keeps a copy of it)."""
    tensors, is_tuple = flatten(batch)
    return unflatten([t.detach() for t in tensors], is_tuple)
