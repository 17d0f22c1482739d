"""The start of a step: split this rank's batches, and fail on every rank together.

Only the rank of the first stage sees the inputs and only the rank of the last
stage the targets, so only they can tell that a batch is missing or does not
split. Every step starts with one small all-reduce (it replaces the barrier
that aligns the ranks' clocks, so it costs no extra round trip) in which each
rank says whether its batches are fine, their sizes, which call it is in and
its step count. A problem on any rank is then raised on every rank, before any
rank sends anything, and the pipeline stays usable.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from twobp.runtime.checks import agree
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.group import World
from twobp.runtime.microbatch import Batch, flatten, split_batch, to_device

_CALLS = {1: "step()", 0: "eval_step()"}


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


def start_step(
    world: World,
    device: torch.device,
    timeout: float,
    given: StepInputs,
    stages: Collection[int],
    n_stages: int,
    n_microbatches: int,
) -> tuple[list[Batch] | None, list[Batch] | None]:
    """This rank's micro-batches of inputs and targets, once every rank's are known to fit.

    Collective: every rank calls it.

    Args:
        world: the group.
        device: where the micro-batches go.
        timeout: seconds to wait for the other ranks.
        given: this rank's batches and call.
        stages: the stages of this rank.
        n_stages: stages of the pipeline.
        n_microbatches: micro-batches per step.

    Returns:
        The micro-batches of inputs (rank of stage 0, else None) and of targets
        (rank of the last stage when targets are needed or given, else None).

    Raises:
        PipelineConfigError: on every rank, if a rank lacks a batch it needs, a
            batch does not split into equal micro-batches, inputs and targets
            differ in size, or the ranks are in different calls or steps.
    """
    last = n_stages - 1
    mb_inputs = mb_targets = None
    sizes = [0, 0]
    problem = None
    rank = world.rank
    try:
        if 0 in stages:
            if given.inputs is None:
                raise PipelineConfigError(
                    f"rank {rank} holds stage 0 and needs the inputs, but got None; "
                    "pass the batch of inputs on this rank"
                )
            mb_inputs = split_batch(to_device(given.inputs, device), n_microbatches)
            sizes[0] = flatten(given.inputs)[0][0].shape[0]
        if last in stages and (given.training or given.targets is not None):
            if given.targets is None:
                raise PipelineConfigError(
                    f"rank {rank} holds the last stage ({last}) and needs the targets to "
                    "compute the loss, but got None; pass the batch of targets on this rank "
                    "(eval_step(inputs) without targets returns the outputs)"
                )
            mb_targets = split_batch(to_device(given.targets, device), n_microbatches, "targets")
            sizes[1] = flatten(given.targets)[0][0].shape[0]
    except PipelineConfigError as exc:
        problem = exc
    call = _CALLS[int(given.training)]
    where = f"at the start of {call} {given.step_count}"
    numbers = [int(given.training), given.step_count, *sizes]
    check_same_call(agree(world, device, timeout, problem, where, numbers))
    return mb_inputs, mb_targets


def check_same_call(table: list[list[int]]) -> None:
    """Raise if the ranks are in different calls or steps, or disagree on the batch size.

    Args:
        table: per rank, ``[training, step_count, input_size, target_size]``
            (sizes 0 where the rank does not hold the batch).

    Raises:
        PipelineConfigError: saying which ranks differ and how.
    """
    first = table[0]
    for rank, row in enumerate(table[1:], start=1):
        if row[0] != first[0]:
            raise PipelineConfigError(
                f"rank 0 called {_CALLS[first[0]]} but rank {rank} called {_CALLS[row[0]]}; "
                "every rank must make the same calls of the pipeline, in the same order"
            )
        if row[1] != first[1]:
            raise PipelineConfigError(
                f"rank 0 is at step {first[1]} but rank {rank} at step {row[1]}; every rank "
                "must call step() the same number of times (a rank skipped or repeated one)"
            )
    inputs = [(r, row[2]) for r, row in enumerate(table) if row[2]]
    targets = [(r, row[3]) for r, row in enumerate(table) if row[3]]
    if inputs and targets and inputs[0][1] != targets[0][1]:
        (r_in, n_in), (r_t, n_t) = inputs[0], targets[0]
        raise PipelineConfigError(
            f"the inputs on rank {r_in} hold {n_in} samples but the targets on rank {r_t} "
            f"hold {n_t}; pass the same batch on every rank"
        )
