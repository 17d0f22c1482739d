"""The start of a step: split this rank's batches, and fail on every rank together.

Only the rank of the first stage sees the inputs and only the rank of the last
stage the targets, so only they can tell that a batch is missing or does not
split. Every step starts with one small all-reduce, which replaces the barrier
that aligns the ranks' clocks: each rank says whether its batches are fine,
which call it is in, its step count and the size of the batch it holds, all in
31 bits (:func:`twobp.runtime.communication.agreement.agree_small`; with 2 ranks, one integer).
A problem on any rank is then raised on every rank, before any rank sends
anything, and the pipeline stays usable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from twobp.runtime.base.topology import Topology
from twobp.runtime.communication.agreement import SMALL_BITS, agree_small
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import Batch, flatten, split_batch, to_device

_CALLS = {1: "step()", 0: "eval_step()"}
# 1 bit for the call, then the step count and the batch size, both modulo (a
# collision only skips a consistency check).
_STEP_BITS = 11
_SIZE_BITS = SMALL_BITS - 1 - _STEP_BITS


@dataclass(frozen=True)
class StepInputs:
    """What one rank was given for one step.

    Args:
        inputs: the batch of model inputs, or None.
        targets: the batch of targets, or None.
        training: True for ``step``, False for ``eval_step``.
        step_count: the rank's count of steps run so far.
    """

    inputs: Batch | None
    targets: Batch | None
    training: bool
    step_count: int


@dataclass(frozen=True)
class CallInfo:
    """What the ranks compare at the start of a step.

    Args:
        training: True for ``step``, False for ``eval_step``.
        step_count: the step count, modulo ``2**11``.
        size: the batch size this rank holds (inputs if it holds stage 0,
            else targets), modulo ``2**18``; 0 if it holds none.
    """

    training: bool
    step_count: int
    size: int

    def pack(self) -> int:
        """This as one integer below ``2**SMALL_BITS``."""
        step = self.step_count % (1 << _STEP_BITS)
        size = self.size % (1 << _SIZE_BITS)
        return (((int(self.training) << _STEP_BITS) | step) << _SIZE_BITS) | size

    @classmethod
    def unpack(cls, value: int) -> CallInfo:
        """Inverse of :meth:`pack`."""
        size = value & ((1 << _SIZE_BITS) - 1)
        value >>= _SIZE_BITS
        return cls(bool(value >> _STEP_BITS), value & ((1 << _STEP_BITS) - 1), size)


def start_step(
    topology: Topology,
    device: torch.device,
    timeout: float,
    given: StepInputs,
    n_microbatches: int,
    buffer: Tensor | None = None,
    ends: tuple[Sequence[int], Sequence[int]] = ((0,), (-1,)),
) -> tuple[list[Batch] | None, list[Batch] | None]:
    """This rank's micro-batches of inputs and targets, once every rank's are known to fit.

    Collective: every rank calls it.

    Args:
        topology: where each stage runs (the ranks of the first and last
            stage need the batches).
        device: where the micro-batches go.
        timeout: seconds to wait for the other ranks.
        given: this rank's batches and call.
        n_microbatches: micro-batches per step.
        buffer: the all-reduce buffer to reuse (see :func:`agree_small`).
        ends: the first stages and the last stages of the schedule (one of
            each per pipeline; -1: the last stage). Their ranks, in this
            process's copy of the pipeline, need the inputs and the targets.

    Returns:
        The micro-batches of inputs (rank of stage 0, else None) and of targets
        (rank of the last stage when targets are needed or given, else None).

    Raises:
        PipelineConfigError: on every rank, if a rank lacks a batch it needs, a
            batch does not split into equal micro-batches, inputs and targets
            differ in size, or the ranks are in different calls or steps.
    """
    world = topology.members
    rank = world.rank
    n_stages = len(topology.placement)
    first_stages = [s % n_stages for s in ends[0]]
    last_stages = [s % n_stages for s in ends[1]]
    firsts = {topology.rank_of_stage(s): s for s in first_stages}
    lasts = {topology.rank_of_stage(s): s for s in last_stages}
    mb_inputs = mb_targets = None
    size = 0
    problem = None
    try:
        if rank in firsts:
            if given.inputs is None:
                raise PipelineConfigError(
                    f"rank {rank} holds stage {firsts[rank]} and needs the inputs, but got None; "
                    "pass the batch of inputs on this rank"
                )
            mb_inputs = split_batch(to_device(given.inputs, device), n_microbatches)
            size = flatten(given.inputs)[0][0].shape[0]
        if rank in lasts and (given.training or given.targets is not None):
            if given.targets is None:
                raise PipelineConfigError(
                    f"rank {rank} holds the last stage ({lasts[rank]}) and needs the "
                    "targets to compute the loss, but got None; pass the batch of targets on "
                    "this rank (eval_step(inputs) without targets returns the outputs)"
                )
            mb_targets = split_batch(to_device(given.targets, device), n_microbatches, "targets")
            n_targets = flatten(given.targets)[0][0].shape[0]
            if rank in firsts:
                check_sizes(rank, size, rank, n_targets)
            size = n_targets if rank not in firsts else size
    except PipelineConfigError as exc:
        problem = exc
    call = _CALLS[int(given.training)]
    mine = CallInfo(given.training, given.step_count, size)
    where = f"at the start of {call} {given.step_count}"
    values = agree_small(world, device, timeout, problem, where, mine.pack(), buffer)
    check_same_call([CallInfo.unpack(v) for v in values])
    return mb_inputs, mb_targets


def check_same_call(calls: Sequence[CallInfo]) -> None:
    """Raise if the ranks are in different calls or steps, or disagree on the batch size.

    Every rank that holds a batch (inputs or targets, in any copy of the
    pipeline) must hold as many samples as the others: each data-parallel
    copy passes its own part of the global batch, all parts of one size.

    Args:
        calls: what each rank reported, by rank.

    Raises:
        PipelineConfigError: saying which ranks differ and how.
    """
    lead = calls[0]
    for rank, call in enumerate(calls[1:], start=1):
        if call.training != lead.training:
            raise PipelineConfigError(
                f"rank 0 called {_CALLS[lead.training]} but rank {rank} called "
                f"{_CALLS[call.training]}; every rank must make the same calls of the "
                "pipeline, in the same order"
            )
        if call.step_count != lead.step_count:
            raise PipelineConfigError(
                f"rank 0 is at step {lead.step_count} but rank {rank} at step "
                f"{call.step_count}; every rank must call step() the same number of times "
                "(a rank skipped or repeated one)"
            )
    holders = [r for r, call in enumerate(calls) if call.size]
    for rank in holders[1:]:
        check_sizes(holders[0], calls[holders[0]].size, rank, calls[rank].size)


def check_sizes(input_rank: int, n_inputs: int, target_rank: int, n_targets: int) -> None:
    """Raise if the inputs and the targets hold different numbers of samples."""
    if n_inputs != n_targets:
        raise PipelineConfigError(
            f"the batch on rank {input_rank} holds {n_inputs} samples but the one on rank "
            f"{target_rank} holds {n_targets}; pass the same batch on every rank of a pipeline "
            "(with data_parallel, each copy's own part of the global batch, all of one size)"
        )
