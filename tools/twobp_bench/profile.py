"""Measure what the simulator needs, on every rank at once: block costs, W tables, the link.

Every rank profiles every block, once per timed round, between the rounds'
variants: the blocks' costs are then measured under the same machine load as
the steps they predict (on a shared machine the load drifts, and a profile
taken once at the start can be far off). The simulator takes the median over
the rounds, and the costs of each stage from the rank that runs it. Measured:

* per block F, I, W and B of one micro-batch (:func:`twobp.partition.profiler.profile_blocks`);
* per block the time of one W concatenated over all ``m`` micro-batches (a
  concatenated W is cheaper than ``m`` single ones, most of all for small
  micro-batches); the simulator interpolates between 1 and ``m``;
* per round, how much slower the ranks compute together than alone (the
  *contention*: on a CPU the ranks share cores, caches and memory bandwidth):
  the F and B of the largest block (by parameters), timed on each rank alone
  (the others wait) and then on all ranks at once. The blocks' costs above are measured
  with every rank profiling at once, so they are the contended costs; the
  simulator check divides them by the contention and lets the simulator slow
  down only the actions that overlap;
* once, the one-way time of a point-to-point message between ranks 0 and 1,
  small and of the size of a stage boundary's activation (latency and bandwidth);
* once, the bandwidth of an all-reduce over every rank, of about a stage's
  gradients (:func:`measure_allreduce`): what the ``R`` of replicated stages
  (Chimera, data parallel) costs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from twobp.engine import defer_weight_grads
from twobp.partition.profiler import BlockCost, profile_blocks, synchronizer
from twobp.runtime.base.group import Membership
from twobp.runtime.execution.microbatch import Batch, flatten, to_device, unflatten
from twobp.runtime.setup.auto.cost_measurement import allreduce_speed, link_speed

_TIMES = ("forward", "backward_input", "backward_weight", "backward_full")


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured, as the simulator check reads it.

    Args:
        blocks: F, I, W, B times and sizes of every block, one micro-batch.
        weight_concat: per block, ``{k: seconds}`` of one W over ``k`` micro-batches.
        link_latency: one-way seconds of an 8-byte message between ranks 0 and 1.
        link_bandwidth: bytes per second between ranks 0 and 1 (``inf`` if not measurable).
        rounds: how many rounds the figures are medians of.
        contention: how many times longer the ranks computed the same work all
            at once than each alone (1.0: no slowdown, or not measured).
        reduce_bandwidth: bytes per second each rank of an all-reduce moved
            (``inf`` if not measured).
    """

    blocks: tuple[BlockCost, ...]
    weight_concat: tuple[dict[int, float], ...]
    link_latency: float
    link_bandwidth: float
    rounds: int = 1
    contention: float = 1.0
    reduce_bandwidth: float = math.inf


class BlockProfiler:
    """Profiles a copy of the blocks, one round at a time.

    Args:
        blocks: the model's blocks (copied; the originals are not touched).
        microbatches: the model inputs of the ``m`` micro-batches of a step.
        device: where to run the blocks.
    """

    def __init__(
        self, blocks: Sequence[nn.Module], microbatches: Sequence[Batch], device: torch.device
    ) -> None:
        self._device = device
        self._blocks = [block.to(device) for block in copy.deepcopy(list(blocks))]
        self._microbatches = [to_device(x, device) for x in microbatches]
        self._block_inputs = _block_inputs(self._blocks, self._microbatches)
        self._rounds: list[tuple[list[BlockCost], list[dict[int, float]]]] = []
        self._contention: list[float] = []

    def measure(self) -> None:
        """Profile every block once more (one warm-up run and one timed run each).

        Collective: every rank calls it at the same point (the contention is
        measured with the ranks taking turns).
        """
        costs = profile_blocks(self._blocks, self._microbatches[0], repeats=1, warmup=1)
        # The largest block: the same on every rank (a timing could differ).
        largest = max(range(len(costs)), key=lambda i: costs[i].parameter_bytes)
        example = self._block_inputs[largest][0]

        def work() -> None:
            _forward_backward(self._blocks[largest], example)

        self._contention.append(measure_contention(work, self._device))
        n = len(self._microbatches)
        tables = []
        for block, cost, inputs in zip(self._blocks, costs, self._block_inputs, strict=True):
            table = {1: cost.backward_weight}
            if n > 1:
                table[n] = _weight_time(block, inputs)
            tables.append(table)
        self._rounds.append((costs, tables))

    def result(self, link: tuple[float, float], reduce_bandwidth: float = math.inf) -> RankProfile:
        """The median of every figure over the rounds measured so far.

        Args:
            link: ``(latency, bandwidth)`` from :func:`measure_link`.
            reduce_bandwidth: from :func:`measure_allreduce`.

        Raises:
            ValueError: if no round was measured.
        """
        if not self._rounds:
            raise ValueError("no profiling round was measured")
        blocks = []
        for index, first in enumerate(self._rounds[0][0]):
            medians = {
                name: statistics.median(getattr(r[0][index], name) for r in self._rounds)
                for name in _TIMES
            }
            blocks.append(dataclasses.replace(first, **medians))
        tables = tuple(
            {k: statistics.median(r[1][index][k] for r in self._rounds) for k in table}
            for index, table in enumerate(self._rounds[0][1])
        )
        contention = statistics.median(self._contention) if self._contention else 1.0
        return RankProfile(
            tuple(blocks),
            tables,
            link[0],
            link[1],
            len(self._rounds),
            max(1.0, contention),
            reduce_bandwidth,
        )


def boundary_bytes(blocks: Sequence[nn.Module], example: Batch) -> int:
    """Bytes of the largest activation between two blocks, for one micro-batch."""
    largest = 8
    with torch.no_grad():
        x = example
        for block in list(blocks)[:-1]:
            x = block(x)
            largest = max(largest, sum(t.numel() * t.element_size() for t in flatten(x)[0]))
    return largest


@torch.no_grad()
def _block_inputs(blocks: Sequence[nn.Module], microbatches: Sequence[Batch]) -> list[list[Batch]]:
    """``out[b][mb]``: the input of block ``b`` for micro-batch ``mb``."""
    out: list[list[Batch]] = [[] for _ in blocks]
    for x in microbatches:
        for index, block in enumerate(blocks):
            out[index].append(x)
            x = block(x)
    return out


def _weight_time(block: nn.Module, inputs: Sequence[Batch]) -> float:
    """Seconds of one W over all of ``inputs`` (their F and I run first, untimed)."""
    store = defer_weight_grads(block, label="profiled block")
    try:
        for mb, x in enumerate(inputs):
            tensors, is_tuple = flatten(x, "block input")
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
            with store.forward(mb):
                outs = flatten(block(unflatten(leaves, is_tuple)), "block output")[0]
            needed = [o for o in outs if o.requires_grad]
            store.backward_input(mb, needed, [torch.ones_like(o) for o in needed], leaves)
        clock = synchronizer(list(block.parameters()))
        start = clock()
        store.backward_weight(range(len(inputs)))
        seconds = clock() - start
        store.finish_step()
    finally:
        store.restore()
        block.zero_grad(set_to_none=True)
    return seconds


def _forward_backward(block: nn.Module, x: Batch) -> None:
    """One plain F and B of ``block`` on ``x`` (the contention's workload)."""
    tensors, is_tuple = flatten(x, "block input")
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    outs = flatten(block(unflatten(leaves, is_tuple)), "block output")[0]
    needed = [o for o in outs if o.requires_grad]
    torch.autograd.backward(needed, [torch.ones_like(o) for o in needed])
    block.zero_grad(set_to_none=True)


def measure_contention(work: Callable[[], None], device: torch.device, repeats: int = 2) -> float:
    """How many times longer ``work`` takes on all ranks at once than on each alone. Collective.

    Each rank in turn runs ``work`` ``repeats`` times while the others wait at
    a barrier (a rank blocked in a barrier does not compute), then all run it
    at once. The shortest run of each is kept (the least disturbed by other
    work on the machine), and the ratio is averaged over the ranks.

    Args:
        work: the same computation on every rank (a block's F and B); it
            should run for milliseconds, not microseconds.
        device: where ``work`` runs (waited for on CUDA) and the ratio is reduced.
        repeats: runs of each measurement.

    Returns:
        The mean over ranks of ``together / alone`` (1.0 without a process group
        of two or more ranks).
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 1.0
    rank, world = dist.get_rank(), dist.get_world_size()

    def timed() -> float:
        runs = []
        for _ in range(repeats):
            start = _synchronized(device)
            work()
            runs.append(_synchronized(device) - start)
        return min(runs)

    work()  # warm-up, all at once
    alone = 0.0
    for turn in range(world):
        dist.barrier()
        if rank == turn:
            alone = timed()
        dist.barrier()
    together = timed()
    ratio = torch.tensor(
        [together / alone if alone > 0 else 1.0], dtype=torch.float64, device=device
    )
    dist.all_reduce(ratio)
    return float(ratio) / world


def _synchronized(device: torch.device) -> float:
    """The clock, once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure_allreduce(nbytes: int, device: torch.device) -> float:
    """Bytes per second each rank of an all-reduce over the default group moves.

    Collective (:func:`twobp.runtime.setup.auto.cost_measurement.allreduce_speed`).

    Args:
        nbytes: the size of the large all-reduce (about a stage's gradients).
        device: where the tensors live.

    Returns:
        The bandwidth; ``inf`` without a group of two ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return math.inf
    return allreduce_speed(_default_world(), device, nbytes)


def _default_world() -> Membership:
    """The default group, every rank on this machine (the bench's local ranks)."""
    size = dist.get_world_size()
    return Membership.of(dist.get_rank(), size, size, dist.group.WORLD, str(dist.get_backend()))


def measure_link(nbytes: int, device: torch.device) -> tuple[float, float]:
    """One-way latency and bandwidth between ranks 0 and 1 of the default group (ping-pong).

    Collective (:func:`twobp.runtime.setup.auto.cost_measurement.link_speed`).

    Args:
        nbytes: the size of the large message (a stage boundary's activation).
        device: where the messages live.

    Returns:
        ``(latency, bandwidth)``; ``(0, inf)`` without a group of two ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 0.0, float("inf")
    return link_speed(_default_world(), (0, 1), device, nbytes)
