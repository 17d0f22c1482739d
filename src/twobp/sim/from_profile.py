"""From measured blocks to the simulator's per-stage cost model (no torch).

A profile measures each block of a model alone: its F, I, W and fused B
times for one micro-batch, the bytes it keeps and the bytes it outputs (see
:class:`twobp.partition.profiler.BlockCost`). A stage's cost is the sum of
its blocks'; a stage boundary sends the output of the stage's last block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from twobp.partition.solver import check_partition, stage_ranges
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

    return CostModel(
        forward=per_stage("forward", contention),
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
