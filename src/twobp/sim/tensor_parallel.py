"""A stage's costs with its blocks split over ``T`` tensor-parallel ranks (no torch).

What :mod:`twobp.models.tensor_parallel` splits costs this, per micro-batch, on each of
the ``T`` ranks of a stage:

- the split modules' share of the stage's compute (``F``, ``I``, ``W``, the fused ``B``)
  and of its weights, gradients and optimizer state runs and is held ``1 / T`` times;
  the rest (norms, an embedding or a head left whole) stays as it was;
- each row-parallel linear (and vocabulary-split embedding) all-reduces its output in
  ``F``, the column-parallel linears that read one input all-reduce its gradient once in
  ``I`` (and in a fused ``B``), and a gathered head all-gathers its logits in ``F``: ring
  collectives over ``T`` ranks
  (:func:`twobp.sim.costs.allreduce_time`, :func:`twobp.sim.costs.reduce_scatter_time`),
  each moving the bytes of the hidden state that enters its block;
- activations and stashes are counted whole (an upper bound: a split module's own
  intermediates are split, the hidden states around it are not), and so are the bytes a
  stage sends to the next (every shard's pipeline sends the whole hidden state).

This is the model :func:`twobp.sim.analytic.layout.stage_costs` prices tensor parallelism
with (two all-reduces per layer each way, as a LLaMA layer runs them), here counted from
the plan and applied to a measured or given cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from twobp.sim.costs import CostModel, allreduce_time, reduce_scatter_time


@dataclass(frozen=True)
class BlockSplit:
    """What a tensor-parallel plan splits of one block.

    Args:
        share: the split modules' share of the block's parameters (elements), taken as
            their share of its compute and its weights; 0: nothing split.
        forward_reduces: all-reduces in ``F`` (row-parallel linears, split embeddings).
        forward_gathers: all-gathers in ``F`` (heads whose logits are gathered).
        input_reduces: all-reduces in ``I`` (one per input that column-parallel linears
            or gathered heads read).
    """

    share: float = 0.0
    forward_reduces: int = 0
    forward_gathers: int = 0
    input_reduces: int = 0


@dataclass(frozen=True)
class Link:
    """What a tensor-parallel collective costs: ``bandwidth`` bytes per second each rank of
    a ring moves, ``latency`` seconds per ring step."""

    bandwidth: float
    latency: float


def tensor_parallel_costs(
    model: CostModel,
    blocks: Sequence[BlockSplit],
    sizes: Sequence[int],
    size: int,
    link: Link,
    block_bytes: Sequence[float],
) -> CostModel:
    """``model`` (one block cut of ``sizes``) with each stage split over ``size`` ranks.

    Args:
        model: the whole blocks' cost model, one entry per stage.
        blocks: what the plan splits of each block.
        sizes: blocks per stage.
        size: tensor-parallel ranks ``T`` (1: ``model`` as it is).
        link: the collectives' bandwidth and latency.
        block_bytes: per block, the bytes of the hidden state entering it (what each of
            its collectives moves).

    Returns:
        The model of one of the ``T`` ranks of every stage.

    Raises:
        ValueError: if ``sizes`` does not cover the blocks or ``size`` < 1.
    """
    if size < 1:
        raise ValueError(f"tensor-parallel size {size}: give 1 or more ranks")
    if sum(sizes) != len(blocks) or len(block_bytes) != len(blocks):
        raise ValueError(f"{len(blocks)} blocks ({len(block_bytes)} sizes) cut into {list(sizes)}")
    if size == 1:
        return model
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    kept, forward, backward = [], [], []
    for start, count in zip(starts, sizes, strict=True):
        mine = range(start, start + count)
        parts = [blocks[b] for b in mine]
        shares = [p.share for p in parts]
        kept.append(1.0 - sum(shares) / count * (1.0 - 1.0 / size))
        forward.append(
            sum(
                p.forward_reduces * allreduce_time(block_bytes[b], size, *_ring(link))
                + p.forward_gathers * reduce_scatter_time(block_bytes[b], size, *_ring(link))
                for b, p in zip(mine, parts, strict=True)
            )
        )
        backward.append(
            sum(
                p.input_reduces * allreduce_time(block_bytes[b], size, *_ring(link))
                for b, p in zip(mine, parts, strict=True)
            )
        )

    def scaled(
        values: Sequence[float] | None, added: Sequence[float] | None = None
    ) -> tuple[float, ...]:
        assert values is not None  # filled in by CostModel
        extra = added or [0.0] * len(values)
        return tuple(v * k + a for v, k, a in zip(values, kept, extra, strict=True))

    concat = model.weight_concat
    if concat is not None:
        concat = tuple(
            None if t is None else {n: v * k for n, v in t.items()}
            for t, k in zip(concat, kept, strict=True)
        )
    return replace(
        model,
        forward=scaled(model.forward, forward),
        forward_full=scaled(model.forward_full, forward),
        backward_input=scaled(model.backward_input, backward),
        backward_full=scaled(model.backward_full, backward),
        backward_weight=scaled(model.backward_weight),
        weight_concat=concat,
        parameter_bytes=scaled(model.parameter_bytes),
        optimizer_bytes=scaled(model.optimizer_bytes),
        gathered_bytes=scaled(model.gathered_bytes),
    )


def _ring(link: Link) -> tuple[float, float]:
    return link.bandwidth, link.latency
