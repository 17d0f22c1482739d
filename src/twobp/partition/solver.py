"""Split a chain of blocks into contiguous pipeline stages: the slowest stage as fast as possible.

A partition is written as block counts per stage, ``[3, 4, 4, 3]``: stage 0
holds blocks 0-2, stage 1 blocks 3-6, and so on. Every stage holds at least one
block, and the blocks keep their order.

:func:`solve` is exact. It finds the smallest possible bottleneck (the largest
stage cost) by a binary search over the sums of contiguous runs of blocks, with
a greedy check of each candidate; then, among the partitions that reach it, a
dynamic program picks the one whose stage costs have the smallest sum of
squares (the most even), and among those the one whose cuts come earliest. The
arithmetic is exact (floats are turned into integers of a common scale), so
equal sums compare equal and ties are broken the same way on every machine.
It takes ``O(n^2 log n + p n^2)`` for ``n`` blocks and ``p`` stages, well under
a second for a few hundred blocks.

This module imports no torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Partition:
    """Blocks per stage, and what each stage costs.

    Args:
        sizes: number of blocks of each stage, in stage order.
        stage_costs: sum of the block costs of each stage.
        bottleneck: the largest stage cost.
        stage_memory: sum of the block memory of each stage, where memory was given.
    """

    sizes: list[int]
    stage_costs: list[float]
    bottleneck: float
    stage_memory: list[float] | None = None

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.sizes)

    def ranges(self) -> list[range]:
        """The block indices of each stage."""
        return stage_ranges(self.sizes)


def stage_ranges(sizes: Sequence[int]) -> list[range]:
    """The block indices of each stage of a partition: ``[2, 3] -> [range(0, 2), range(2, 5)]``."""
    ends = list(accumulate(sizes))
    return [range(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def uniform(n_blocks: int, n_stages: int) -> list[int]:
    """Equal block counts per stage; the remainder goes to the middle stages.

    With ``r = n_blocks % n_stages`` extra blocks, stages ``(n_stages - r) // 2``
    up to ``(n_stages - r) // 2 + r - 1`` get one more block than the others. The
    first and last stages also carry the embedding and the head, so they are the
    last to get an extra block.

    Args:
        n_blocks: number of blocks, at least ``n_stages``.
        n_stages: number of stages, at least 1.

    Returns:
        Block counts per stage, differing by at most one.

    Raises:
        ValueError: if there are fewer blocks than stages, or no stage.
    """
    _check_counts(n_blocks, n_stages)
    base, extra = divmod(n_blocks, n_stages)
    first = (n_stages - extra) // 2
    return [base + (first <= s < first + extra) for s in range(n_stages)]


def check_partition(partition: Sequence[int], n_blocks: int, n_stages: int) -> None:
    """Check that ``partition`` splits ``n_blocks`` blocks into ``n_stages`` non-empty stages.

    Args:
        partition: block counts per stage.
        n_blocks: number of blocks of the model.
        n_stages: number of stages of the pipeline.

    Raises:
        ValueError: saying what is wrong: the number of stages, an empty or
            negative stage, or a total other than ``n_blocks``.
    """
    sizes = list(partition)
    if len(sizes) != n_stages:
        raise ValueError(
            f"partition {sizes} has {len(sizes)} stages, but the pipeline has {n_stages}; "
            f"give one block count per stage"
        )
    bad = [s for s, size in enumerate(sizes) if not isinstance(size, int) or size < 1]
    if bad:
        raise ValueError(
            f"partition {sizes}: stage(s) {bad} hold no block; every stage needs at least one"
        )
    if sum(sizes) != n_blocks:
        raise ValueError(
            f"partition {sizes} covers {sum(sizes)} blocks, but the model has {n_blocks}; "
            f"the counts must add up to {n_blocks}"
        )


def evaluate(
    costs: Sequence[float], partition: Sequence[int], memory: Sequence[float] | None = None
) -> Partition:
    """The stage costs (and memory) of a given partition, e.g. to compare it with :func:`solve`.

    Args:
        costs: cost of each block.
        partition: block counts per stage.
        memory: memory of each block, or ``None``.

    Returns:
        The partition with its stage sums.

    Raises:
        ValueError: if the partition does not cover ``len(costs)`` blocks.
    """
    sizes = list(partition)
    check_partition(sizes, len(costs), len(sizes))
    return _result(sizes, costs, memory)


def solve(
    costs: Sequence[float],
    n_stages: int,
    *,
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> Partition:
    """The contiguous partition whose slowest stage is fastest.

    Among partitions with the smallest bottleneck, the one with the smallest sum
    of squared stage costs wins; remaining ties go to the earliest cuts (the
    lexicographically smallest ``sizes``).

    Args:
        costs: cost of each block (e.g. forward + backward-input + backward-weight
            time), finite and non-negative.
        n_stages: number of stages, at most ``len(costs)``.
        memory: memory of each block (finite, non-negative), needed with ``memory_limit``.
        memory_limit: the most memory one stage may hold.

    Returns:
        The block counts per stage with their costs (and memory, where given).

    Raises:
        ValueError: on bad inputs, more stages than blocks, a block whose
            memory alone is over the limit, or a limit that no split into
            ``n_stages`` stages meets.
    """
    n_blocks = len(costs)
    _check_counts(n_blocks, n_stages)
    _check_values("costs", costs)
    if memory is not None:
        if len(memory) != n_blocks:
            raise ValueError(f"memory has {len(memory)} entries but costs have {n_blocks}")
        _check_values("memory", memory)
    if memory_limit is not None:
        if memory is None:
            raise ValueError("memory_limit needs the memory of each block: pass memory=[...]")
        _check_blocks_fit(memory, memory_limit)

    cost = _exact_integers(costs)
    # Memory and its limit share one scale so that the comparison stays exact.
    mem, limit = [0] * n_blocks, 0
    if memory is not None and memory_limit is not None:
        *mem, limit = _exact_integers([*memory, memory_limit])
    fits = _Fits(cost, mem, limit if memory_limit is not None else None)
    prefix = [0, *accumulate(cost)]
    # With the whole chain as bottleneck only memory limits the stages.
    needed = fits.min_stages(prefix[-1])
    if needed > n_stages:
        raise ValueError(
            f"the blocks need at least {needed} stages to keep each under memory_limit "
            f"{memory_limit:g} (total memory {math.fsum(memory or []):g}), but there are "
            f"only {n_stages}: raise the limit or use more stages"
        )

    candidates = sorted(
        {prefix[j] - prefix[i] for i in range(n_blocks) for j in range(i + 1, n_blocks + 1)}
    )
    # The smallest candidate bottleneck that some split into n_stages meets;
    # the largest (the whole chain) always does once memory fits.
    lo = bisect.bisect_left(
        range(len(candidates)), True, key=lambda k: fits.min_stages(candidates[k]) <= n_stages
    )
    sizes = _most_even(fits, candidates[lo], n_stages)
    return _result(sizes, costs, memory)


class _Fits:
    """Which runs of blocks can form one stage under a bottleneck and the memory limit."""

    def __init__(self, cost: list[int], mem: list[int], limit: int | None) -> None:
        self.cost, self.mem, self.limit = cost, mem, limit

    def longest_from(self, start: int, bottleneck: int) -> int:
        """The end (exclusive) of the longest run from ``start`` that fits; ``start`` if none."""
        total = memory = 0
        end = start
        while end < len(self.cost):
            total += self.cost[end]
            memory += self.mem[end]
            if total > bottleneck or (self.limit is not None and memory > self.limit):
                break
            end += 1
        return end

    def min_stages(self, bottleneck: int) -> int:
        """The fewest stages whose costs all stay within ``bottleneck`` (a large number if none)."""
        stages, start = 0, 0
        while start < len(self.cost):
            end = self.longest_from(start, bottleneck)
            if end == start:
                return len(self.cost) + 1
            stages, start = stages + 1, end
        return stages


def _most_even(fits: _Fits, bottleneck: int, n_stages: int) -> list[int]:
    """Among splits within ``bottleneck``, the least sum of squares, then the earliest cuts."""
    n = len(fits.cost)
    prefix = [0, *accumulate(fits.cost)]
    longest = [fits.longest_from(i, bottleneck) for i in range(n)]
    unreachable = None
    # best[k][i]: least sum of squared stage costs splitting blocks i.. into k stages.
    best: list[list[int | None]] = [[unreachable] * (n + 1) for _ in range(n_stages + 1)]
    best[0][n] = 0
    for k in range(1, n_stages + 1):
        for i in range(n - k, -1, -1):
            options = [
                (prefix[j] - prefix[i]) ** 2 + rest
                for j in range(i + 1, min(longest[i], n - k + 1) + 1)
                if (rest := best[k - 1][j]) is not None
            ]
            best[k][i] = min(options) if options else unreachable
    sizes: list[int] = []
    start = 0
    for k in range(n_stages, 0, -1):
        target = best[k][start]
        for end in range(start + 1, longest[start] + 1):
            rest = best[k - 1][end]
            if rest is not None and (prefix[end] - prefix[start]) ** 2 + rest == target:
                break
        sizes.append(end - start)
        start = end
    return sizes


def _check_blocks_fit(memory: Sequence[float], limit: float) -> None:
    too_big = [i for i, m in enumerate(memory) if m > limit]
    if too_big:
        i = too_big[0]
        raise ValueError(
            f"block {i} alone needs {memory[i]:g} of memory, more than memory_limit {limit:g}; "
            f"no stage can hold it: raise the limit or split the block"
        )


def _check_counts(n_blocks: int, n_stages: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if n_stages > n_blocks:
        raise ValueError(
            f"cannot split {n_blocks} blocks into {n_stages} non-empty stages: "
            f"use at most {n_blocks} stages"
        )


def _check_values(name: str, values: Sequence[float]) -> None:
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"{name} must be finite and >= 0; block {bad[0]} has {values[bad[0]]!r}")


def _exact_integers(values: Sequence[float]) -> list[int]:
    """The values as integers of one common scale, exactly (floats are dyadic rationals)."""
    ratios = [float(v).as_integer_ratio() for v in values]
    # Every denominator is a power of two, so the largest is a multiple of all.
    scale = max((d for _, d in ratios), default=1)
    return [n * (scale // d) for n, d in ratios]


def _result(sizes: list[int], costs: Sequence[float], memory: Sequence[float] | None) -> Partition:
    ranges = stage_ranges(sizes)
    stage_costs = [math.fsum(costs[i] for i in r) for r in ranges]
    stage_memory = None if memory is None else [math.fsum(memory[i] for i in r) for r in ranges]
    return Partition(sizes, stage_costs, max(stage_costs), stage_memory)
