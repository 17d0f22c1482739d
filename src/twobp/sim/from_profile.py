"""From measured blocks to the simulator's per-stage cost model (no torch).

A profile measures each block of a model alone: its F, I, W and fused B
times for one micro-batch, the bytes it keeps and the bytes it outputs (see
:class:`twobp.partition.profiler.BlockCost`). A stage's cost is the sum of
its blocks'; a stage boundary sends the output of the stage's last block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from twobp.partition.solver import check_partition, solve, stage_ranges, uniform
from twobp.sim.costs import CostModel


class BlockFigures(Protocol):
    """What the cost model reads of one measured block (times in seconds, sizes in bytes)."""

    @property
    def forward(self) -> float: ...

    @property
    def backward_input(self) -> float: ...

    @property
    def backward_weight(self) -> float: ...

    @property
    def backward_full(self) -> float: ...

    @property
    def activation_bytes(self) -> int: ...

    @property
    def weight_grad_bytes(self) -> int: ...

    @property
    def output_bytes(self) -> int: ...

    @property
    def parameter_bytes(self) -> int: ...


def stage_cost_model(
    blocks: Sequence[BlockFigures],
    sizes: Sequence[int],
    *,
    weight_concat: Sequence[Mapping[int, float]] | None = None,
    contention: float = 1.0,
    **options: Any,
) -> CostModel:
    """The per-stage cost model of a partition, for the simulator.

    Args:
        blocks: the measured blocks, in model order.
        sizes: block counts per stage (a partition).
        weight_concat: per block, ``{k: seconds}`` of one W over ``k``
            micro-batches; a stage's table holds the counts all its blocks
            have, summed. None: W over ``k`` micro-batches costs ``k`` single ones.
        contention: how many times slower the blocks ran than alone, because
            the ranks measured them all at once (see
            :class:`~twobp.sim.costs.CostModel`). Every time is divided by it,
            and the model carries it, so that the simulator slows down only
            the actions that overlap.
        **options: further :class:`~twobp.sim.costs.CostModel` fields
            (``send_latency``, ``bandwidth``, ``meta``...).

    Returns:
        Stage sums of the block times and sizes.

    Raises:
        ValueError: if ``sizes`` does not cover the blocks, or ``weight_concat``
            does not have one table per block.
    """
    check_partition(sizes, len(blocks), len(sizes))
    if weight_concat is not None and len(weight_concat) != len(blocks):
        raise ValueError(f"weight_concat has {len(weight_concat)} tables for {len(blocks)} blocks")
    ranges = stage_ranges(list(sizes))

    def per_stage(field: str, scale: float = 1.0) -> tuple[float, ...]:
        return tuple(float(sum(getattr(blocks[i], field) for i in r)) / scale for r in ranges)

    def table(r: range) -> dict[int, float]:
        assert weight_concat is not None
        counts = set.intersection(*(set(weight_concat[i]) for i in r))
        return {k: sum(weight_concat[i][k] for i in r) / contention for k in sorted(counts)}

    plain = all(getattr(b, "forward_full", None) is not None for b in blocks)
    return CostModel(
        forward=per_stage("forward", contention),
        forward_full=per_stage("forward_full", contention) if plain else None,
        backward_input=per_stage("backward_input", contention),
        backward_weight=per_stage("backward_weight", contention),
        backward_full=per_stage("backward_full", contention),
        weight_concat=None if weight_concat is None else tuple(table(r) for r in ranges),
        send_bytes=tuple(float(blocks[r[-1]].output_bytes) for r in ranges),
        activation_bytes=per_stage("activation_bytes"),
        weight_grad_bytes=per_stage("weight_grad_bytes"),
        parameter_bytes=per_stage("parameter_bytes"),
        contention=contention,
        **options,
    )


SizesFor = Callable[[int], tuple[int, ...]]
"""Blocks per stage for a schedule of the given number of stages."""
CostsFor = Callable[[int], CostModel]
"""The cost model of the model cut into the given number of stages (one pipeline's worth)."""


PARTITION_STRATEGIES = ("uniform", "balanced")
"""Partition strategies known by name."""


def stage_sizes(
    n_blocks: int, n_stages: int, partition: Sequence[int] | str | None
) -> tuple[int, ...] | None:
    """Blocks per stage for explicit counts, ``"uniform"`` or None; None for ``"balanced"``.

    Args:
        n_blocks: blocks of the model.
        n_stages: stages to cut it into.
        partition: block counts per stage, ``"uniform"`` or None, or
            ``"balanced"`` (which needs measured costs: see :func:`partition_for`).

    Returns:
        The counts, or None for ``"balanced"``.

    Raises:
        ValueError: if the model has fewer blocks than stages, the strategy
            is unknown, or the counts do not split the blocks into ``n_stages``.
    """
    if n_blocks < n_stages:
        raise ValueError(
            f"the model has {n_blocks} blocks but the schedule has {n_stages} stages; "
            f"{n_stages} stages need at least {n_stages} blocks, one each: split the model "
            "into more blocks or use fewer ranks / stages per rank"
        )
    if partition == "balanced":
        return None
    if partition is None or partition == "uniform":
        return tuple(uniform(n_blocks, n_stages))
    if isinstance(partition, str):
        raise ValueError(
            f"unknown partition strategy {partition!r}; use one of "
            f"{', '.join(PARTITION_STRATEGIES)} or a list with the number of blocks of each stage"
        )
    if len(partition) != n_stages:
        raise ValueError(
            f"partition {list(partition)} has {len(partition)} stages, not {n_stages}; "
            "give one block count per stage"
        )
    check_partition(list(partition), n_blocks, n_stages)
    return tuple(partition)


def partition_for(
    n_blocks: int, partition: Sequence[int] | str | None, block_costs: Sequence[float] | None
) -> SizesFor:
    """How the blocks split into any number of stages.

    Args:
        n_blocks: blocks of the model.
        partition: block counts per stage (then only that many stages),
            ``"uniform"`` or None, or ``"balanced"`` (by ``block_costs``).
        block_costs: per block ``F + I + W`` time, for ``"balanced"``.

    Returns:
        ``n_stages -> sizes``, which raises ValueError where the blocks do not
        split so (see :func:`stage_sizes`).
    """

    def sizes(n_stages: int) -> tuple[int, ...]:
        fixed = stage_sizes(n_blocks, n_stages, partition)
        if fixed is not None:
            return fixed
        if block_costs is None:
            raise ValueError("partition='balanced' needs measured block costs")
        return tuple(solve(list(block_costs), n_stages).sizes)

    return sizes


def with_optimizer_state(
    costs_for: CostsFor,
    sizes_for: SizesFor,
    block_parameters: Sequence[int],
    state_bytes: float,
    sharded: bool = False,
    weights_share: float | None = None,
) -> CostsFor:
    """The cost models with each stage's optimizer state, and sharded if it will be.

    Args:
        costs_for: the cost model of each number of stages.
        sizes_for: the blocks per stage of each number of stages.
        block_parameters: the parameters (elements) of each block.
        state_bytes: bytes of optimizer state per parameter (0: the models'
            own ``optimizer_bytes`` stay).
        sharded: the state will be sharded over each stage's holders
            (``CostModel.shard_optimizer``), its gathers waited for block by
            block (``gather_pieces``: the fewest blocks of a stage).
        weights_share: the parameters and gradients will be sharded too
            (``Pipeline(shard_parameters=True)``, ``CostModel.shard_parameters``):
            the share of a stage's ``parameter_bytes`` that are its weights, which a
            rank holds whole from the stage's first ``F`` to its last ``I``
            (``gathered_bytes``); None: not sharded.

    Returns:
        ``n_stages -> cost model``.

    Raises:
        ValueError: if ``state_bytes`` is negative or not finite, or ``weights_share``
            is not within (0, 1].
    """
    if not (state_bytes >= 0 and math.isfinite(state_bytes)):
        raise ValueError(
            f"optimizer_state_bytes={state_bytes!r}: give the bytes of optimizer state per "
            "parameter (AdamW in float32: 8), or 0 not to count it"
        )
    if weights_share is not None and not 0 < weights_share <= 1:
        raise ValueError(f"weights_share={weights_share!r}: give a share within (0, 1]")
    if not state_bytes and not sharded and weights_share is None:
        return costs_for

    def costs(n_stages: int) -> CostModel:
        model, sizes = costs_for(n_stages), sizes_for(n_stages)
        changes: dict[str, Any] = {}
        if state_bytes:
            starts = [sum(sizes[:s]) for s in range(len(sizes))]
            changes["optimizer_bytes"] = tuple(
                state_bytes * sum(block_parameters[a : a + n])
                for a, n in zip(starts, sizes, strict=True)
            )
        if sharded or weights_share is not None:
            changes["shard_optimizer"] = True
            changes["gather_pieces"] = max(1, min(sizes))
        if weights_share is not None:
            assert model.parameter_bytes is not None
            changes["shard_parameters"] = True
            changes["gathered_bytes"] = tuple(b * weights_share for b in model.parameter_bytes)
        return replace(model, **changes)

    return costs


def profiled_costs(
    blocks: Sequence[BlockFigures],
    weight_concat: Sequence[Mapping[int, float]] | None,
    sizes_for: SizesFor,
    *,
    contention: float = 1.0,
    parameter_factor: float = 1.0,
    **options: Any,
) -> CostsFor:
    """Cost models of any number of stages from blocks measured alone.

    Args:
        blocks: the measured blocks (alone: not divided by ``contention``).
        weight_concat: per block ``{k: seconds}`` of W over ``k`` micro-batches.
        sizes_for: the partition for each stage count (:func:`partition_for`).
        contention: the slowdown of all ranks computing at once, which the
            simulator applies to overlapping actions.
        parameter_factor: bytes held per parameter byte (2: weights and gradients).
        **options: further :class:`~twobp.sim.costs.CostModel` fields.

    Returns:
        ``n_stages -> cost model``.
    """

    def costs(n_stages: int) -> CostModel:
        model = stage_cost_model(
            blocks, sizes_for(n_stages), weight_concat=weight_concat, **options
        )
        assert model.parameter_bytes is not None
        return replace(
            model,
            contention=contention,
            parameter_bytes=tuple(parameter_factor * b for b in model.parameter_bytes),
        )

    return costs
