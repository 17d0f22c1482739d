"""Which blocks of the model each stage holds.

The ``partition`` argument of a pipeline is block counts per stage, a strategy
name, or None. ``"uniform"`` and explicit counts are resolved here, with the
rules the simulator's search follows (:func:`twobp.sim.from_profile.stage_sizes`);
``"balanced"`` profiles the blocks (:func:`balanced_counts`) on rank 0 and
shares the solver's answer, so every rank splits the model the same way even
though their timings differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from twobp.partition import solve
from twobp.runtime.base.group import Membership
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import Batch, to_device
from twobp.sim.from_profile import PARTITION_STRATEGIES, stage_sizes

STRATEGIES = PARTITION_STRATEGIES
"""Partition strategies known by name."""


def stage_counts(
    n_blocks: int, n_stages: int, partition: Sequence[int] | str | None
) -> list[int] | None:
    """Blocks per stage for explicit counts, ``"uniform"`` or None; None for ``"balanced"``.

    The rules are those of :func:`twobp.sim.from_profile.stage_sizes`, which
    the simulator's search follows too.

    Raises:
        PipelineConfigError: if the model has fewer blocks than stages, the
            counts do not fit, or the strategy is unknown.
    """
    try:
        counts = stage_sizes(n_blocks, n_stages, partition)
    except ValueError as exc:
        raise PipelineConfigError(str(exc)) from exc
    return None if counts is None else list(counts)


def balanced_counts(
    blocks: Sequence[nn.Module],
    n_stages: int,
    example_input: Batch | None,
    world: Membership,
    device: torch.device,
) -> list[int]:
    """Blocks per stage that balance the measured F + I + W time of the stages.

    Rank 0 profiles every block on one micro-batch and solves; the other
    ranks receive its answer (a collective: every rank calls this).

    Args:
        blocks: the whole model's blocks.
        n_stages: number of stages.
        example_input: one micro-batch of model inputs, as the first block takes it.
        world: the group.
        device: where rank 0 runs the blocks while profiling.

    Returns:
        Block counts per stage.

    Raises:
        PipelineConfigError: if no example input was given; on the other ranks, if
            profiling or solving failed on rank 0 (which raises its own error).
    """
    example_input_needed(example_input)
    assert example_input is not None
    answer: list[list[int] | str | None] = [None]
    failure: Exception | None = None
    if world.rank == 0:
        from twobp.partition.profiler import profile_blocks, solver_costs

        homes = [device_of(b) for b in blocks]
        try:
            moved = [b.to(device) for b in blocks]
            costs = profile_blocks(moved, to_device(example_input, device))
            answer[0] = solve(solver_costs(costs), n_stages).sizes
        except Exception as exc:  # a block that fails: every rank hears of it, none waits
            failure = exc
            answer[0] = f"{type(exc).__name__}: {exc}"
        finally:
            for block, home in zip(blocks, homes, strict=True):
                block.to(home)
    if world.group is not None:
        dist.broadcast_object_list(answer, src=world.global_rank(0), group=world.group)
    if failure is not None:
        raise failure
    if isinstance(answer[0], str):
        raise PipelineConfigError(
            f"rank {world.rank}: rank 0 failed to profile the blocks to balance the stages "
            f"({answer[0]}); see rank 0's error"
        )
    assert answer[0] is not None
    return answer[0]


def example_input_needed(example_input: Batch | None) -> None:
    """Check that a balanced partition has its example input.

    Raises:
        PipelineConfigError: if ``example_input`` is None.
    """
    if example_input is None:
        raise PipelineConfigError(
            "partition='balanced' profiles the blocks and needs example_input=<one "
            "micro-batch of model inputs>; pass it, or give the block counts per stage"
        )


def device_of(block: nn.Module) -> torch.device:
    """Where the block's parameters live (the CPU if it has none)."""
    for tensor in block.parameters():
        return tensor.device
    return torch.device("cpu")
