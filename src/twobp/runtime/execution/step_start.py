"""The start of a step: split this rank's batches, and fail on every rank together.

Only the rank of the first stage sees the inputs and only the rank of the last
stage the targets, so only they can tell that a batch is missing or does not
split. Every step starts with one small sum over the ranks (an all-reduce, or between
two gloo ranks a point-to-point exchange), which replaces the barrier
that aligns the ranks' clocks: each rank says whether its batches are fine,
which call it is in, its step count, the size of the batch it holds and, on
the rank of each copy's first stage, which slot of learnt boundary layouts
the step's input shapes use (:mod:`twobp.runtime.communication.layout_cache`),
all in 30 bits (:func:`twobp.runtime.communication.agreement.agree_small`;
with 2 ranks, one integer). A problem on any rank is then raised on every rank,
before any rank sends anything, and the pipeline stays usable.

A batch of ``B`` rows splits into ``n_microbatches`` micro-batches as
``torch.tensor_split`` cuts it, and each micro-batch's loss is weighted by its
share of the rows of the global batch (every data-parallel copy's together),
so that a mean-reduced loss gives the step the loss and gradients of one
process on the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from twobp.runtime.base.topology import Topology
from twobp.runtime.communication.agreement import SMALL_BITS, agree, agree_small
from twobp.runtime.communication.layout_cache import (
    NO_SLOT,
    SLOT_BITS,
    BoundaryLayouts,
    LayoutCache,
    input_signature,
)
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import (
    Batch,
    batch_size,
    flatten,
    microbatch_sizes,
    split_batch,
    to_device,
)

_CALLS = {1: "step()", 0: "eval_step()"}
# 1 bit for the call, the step count modulo 2**6 (a collision only skips a
# consistency check), the layout slot, and the batch size (exact below OVERFLOW).
_STEP_BITS = 6
_SIZE_BITS = SMALL_BITS - 1 - _STEP_BITS - SLOT_BITS
OVERFLOW = (1 << _SIZE_BITS) - 1
"""The size field of a batch this large or larger: the exact sizes follow in a second
all-reduce."""


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
        step_count: the step count, modulo ``2**6``.
        size: the batch size this rank holds (inputs if it holds stage 0,
            else targets), at most :data:`OVERFLOW`; 0 if it holds none.
        slot: on the rank that decides the layouts of its copy, the slot code
            of :meth:`LayoutCache.propose`; else 0.
    """

    training: bool
    step_count: int
    size: int
    slot: int = NO_SLOT

    def pack(self) -> int:
        """This as one integer below ``2**SMALL_BITS``."""
        step = self.step_count % (1 << _STEP_BITS)
        value = (int(self.training) << _STEP_BITS) | step
        value = (value << SLOT_BITS) | self.slot
        return (value << _SIZE_BITS) | min(self.size, OVERFLOW)

    @classmethod
    def unpack(cls, value: int) -> CallInfo:
        """Inverse of :meth:`pack` (a size of :data:`OVERFLOW` or more reads as it)."""
        size = value & OVERFLOW
        value >>= _SIZE_BITS
        slot = value & ((1 << SLOT_BITS) - 1)
        value >>= SLOT_BITS
        return cls(bool(value >> _STEP_BITS), value & ((1 << _STEP_BITS) - 1), size, slot)


@dataclass(frozen=True)
class StepBatches:
    """What one rank runs a step on, as every rank agreed.

    Args:
        inputs: this rank's micro-batches of inputs (rank of a first stage), else None.
        targets: its micro-batches of targets (rank of a last stage, when
            targets are needed or given), else None.
        rows: the rows of each micro-batch of this copy of the pipeline.
        weights: the weight of each micro-batch's loss: its rows over the
            rows of every copy's batch, times the number of copies (whose
            gradients are averaged).
        layouts: the boundary layouts learnt for the step's input shapes
            (empty when the step learns them).
        learning: True when the step learns its layouts afresh.
        code: the slot code every rank agreed on (see :class:`LayoutCache`).
    """

    inputs: list[Batch] | None
    targets: list[Batch] | None
    rows: tuple[int, ...]
    weights: tuple[float, ...]
    layouts: BoundaryLayouts
    learning: bool
    code: int = 0


def start_step(
    topology: Topology,
    device: torch.device,
    timeout: float,
    given: StepInputs,
    n_microbatches: int,
    layouts: LayoutCache,
    buffer: Tensor | None = None,
    ends: tuple[Sequence[int], Sequence[int]] = ((0,), (-1,)),
) -> StepBatches:
    """This rank's micro-batches of inputs and targets, once every rank's are known to fit.

    Collective: every rank calls it.

    Args:
        topology: where each stage runs (the ranks of the first and last
            stage need the batches).
        device: where the micro-batches go.
        timeout: seconds to wait for the other ranks.
        given: this rank's batches and call.
        n_microbatches: micro-batches per step.
        layouts: the layouts learnt for this kind of call, by input signature.
        buffer: the all-reduce buffer to reuse (see :func:`agree_small`).
        ends: the first stages and the last stages of the schedule (one of
            each per pipeline; -1: the last stage). Their ranks, in this
            process's copy of the pipeline, need the inputs and the targets.

    Returns:
        The step's micro-batches, their rows and loss weights, and its layouts.

    Raises:
        PipelineConfigError: on every rank, if a rank lacks a batch it needs, a
            batch holds fewer rows than micro-batches, inputs and targets
            differ in size, or the ranks are in different calls or steps.
    """
    world = topology.members
    rank = world.rank
    n_stages = len(topology.placement)
    first_stages = [s % n_stages for s in ends[0]]
    last_stages = [s % n_stages for s in ends[1]]
    firsts = {topology.rank_of_stage(s): s for s in first_stages}
    lasts = {topology.rank_of_stage(s): s for s in last_stages}
    decider = topology.rank_of_stage(first_stages[0])
    own = _own_batches(rank, firsts, lasts, rank == decider, given, device, n_microbatches, layouts)
    mb_inputs, mb_targets, size, slot, signature, problem = own
    call = _CALLS[int(given.training)]
    mine = CallInfo(given.training, given.step_count, size, slot)
    where = f"at the start of {call} {given.step_count}"
    values = agree_small(world, device, timeout, problem, where, mine.pack(), buffer)
    calls = [CallInfo.unpack(v) for v in values]
    if any(c.size == OVERFLOW for c in calls):
        exact = agree(world, device, timeout, None, where, [size])
        calls = [
            CallInfo(c.training, c.step_count, e[0], c.slot)
            for c, e in zip(calls, exact, strict=True)
        ]
    copies = copy_ends(topology, first_stages, last_stages)
    check_same_call(calls, copies)
    rows = microbatch_sizes(calls[decider].size, n_microbatches)
    total = sum(calls[first[0]].size for first, _ in copies)
    weights = tuple(r * topology.dp_size / total for r in rows)
    code = calls[decider].slot
    return StepBatches(
        mb_inputs,
        mb_targets,
        rows,
        weights,
        layouts.settle(code, signature),
        learning=layouts.learns(code),
        code=code,
    )


def _own_batches(
    rank: int,
    firsts: dict[int, int],
    lasts: dict[int, int],
    decides: bool,
    given: StepInputs,
    device: torch.device,
    n_microbatches: int,
    layouts: LayoutCache,
) -> tuple[Any, Any, int, int, Any, PipelineConfigError | None]:
    """This rank's micro-batches of inputs and targets (where its stages need them), the
    batch size it sees, and, on the rank that decides the layout, its proposed slot and
    the inputs' signature; with the problem that this rank found, to tell every rank."""
    mb_inputs = mb_targets = None
    size = 0
    slot = NO_SLOT
    signature = None
    try:
        if rank in firsts:
            if given.inputs is None:
                raise PipelineConfigError(
                    f"rank {rank} holds stage {firsts[rank]} and needs the inputs, but got None; "
                    "pass the batch of inputs on this rank"
                )
            mb_inputs = split_batch(to_device(given.inputs, device), n_microbatches)
            size = batch_size(given.inputs)
            if decides:
                signature = input_signature(*flatten(given.inputs))
                slot = layouts.propose(signature)
        if rank in lasts and (given.training or given.targets is not None):
            if given.targets is None:
                raise PipelineConfigError(
                    f"rank {rank} holds the last stage ({lasts[rank]}) and needs the "
                    "targets to compute the loss, but got None; pass the batch of targets on "
                    "this rank (eval_step(inputs) without targets returns the outputs)"
                )
            mb_targets = split_batch(to_device(given.targets, device), n_microbatches, "targets")
            n_targets = batch_size(given.targets, "targets")
            if rank in firsts:
                check_sizes(f"the inputs on rank {rank}", size, "its targets", n_targets)
            size = n_targets if rank not in firsts else size
    except PipelineConfigError as exc:
        return mb_inputs, mb_targets, size, slot, signature, exc
    return mb_inputs, mb_targets, size, slot, signature, None


def copy_ends(
    topology: Topology, first_stages: Sequence[int], last_stages: Sequence[int]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """For each copy of the pipeline, the group ranks of its first stages and of its last.

    The first rank of a copy's first stages decides its layouts.
    """
    firsts = topology.replicas(first_stages[0])
    lasts = topology.replicas(last_stages[0])
    n_first, n_last = len(firsts) // topology.dp_size, len(lasts) // topology.dp_size
    return [
        (firsts[d * n_first : (d + 1) * n_first], lasts[d * n_last : (d + 1) * n_last])
        for d in range(topology.dp_size)
    ]


def check_same_call(
    calls: Sequence[CallInfo],
    copies: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> None:
    """Raise if the ranks are in different calls or steps, or disagree on the batch size.

    Every rank of one copy of the pipeline that holds a batch (inputs or
    targets) must hold as many samples as the others of that copy; copies
    may hold parts of the global batch of different sizes.

    Args:
        calls: what each rank reported, by rank.
        copies: for each copy, the ranks of its first stages and of its last
            stages (None: one copy, whose ranks are all those that hold a batch).

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
    everyone = tuple(range(len(calls)))
    groups = [(everyone, everyone)] if copies is None else copies
    for first, last in groups:
        holders = [r for r in dict.fromkeys([*first, *last]) if calls[r].size]
        for rank in holders[1:]:
            check_sizes(
                _batch_of(holders[0], first, last),
                calls[holders[0]].size,
                _batch_of(rank, first, last),
                calls[rank].size,
            )


def check_sizes(first: str, n_first: int, second: str, n_second: int) -> None:
    """Raise if two batches of one step (``first`` and ``second``, named as "the inputs on
    rank 0") hold different numbers of samples."""
    if n_first != n_second:
        raise PipelineConfigError(
            f"{first} {_hold(first)} {n_first} samples but {second} {_hold(second)} "
            f"{n_second}; the inputs and the targets of a step are one batch: pass them with "
            "the same number of samples (with data_parallel, each copy the same part of the "
            "global batch on each of its ranks)"
        )


def _hold(what: str) -> str:
    return "holds" if what.startswith("the batch") else "hold"


def _batch_of(rank: int, first: Sequence[int], last: Sequence[int]) -> str:
    """What a rank of one copy holds of a step's batch, named with the rank."""
    if rank in first and rank not in last:
        return f"the inputs on rank {rank}"
    if rank in last and rank not in first:
        return f"the targets on rank {rank}"
    return f"the batch on rank {rank}"
