"""What ``schedule="auto"`` measures: the blocks' costs, the ranks' contention, the link.

Rank 0 times every block (F, I, W, the fused B, the bytes kept, and W over
several micro-batches at once) in rounds, the others waiting; then all
ranks measure together how much slower they compute at once than alone, and
the one-way latency and bandwidth between pipeline ranks 0 and 1 of the
first copy of the pipeline, and how long the first is held by posting a
boundary's message while the second computes (gloo copies it in the caller),
and with several copies of the pipeline the bandwidth of an all-reduce.
Collective.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.partition.profiler import (
    BlockCost,
    profile_blocks,
    restored,
    synchronizer,
    weight_group_times,
)
from twobp.runtime.base.group import Membership
from twobp.runtime.communication.collective import all_gather_objects
from twobp.runtime.execution.microbatch import Batch, to_device
from twobp.runtime.setup.stage_blocks import device_of

PROFILE_ROUNDS = 5
"""Rounds of block timings the profile is the median of."""
CONTENTION_ROUNDS = 5
"""Rounds of alone and together runs the contention is the median of."""
LINK_REPEATS = 20
"""Ping-pongs per message size when measuring a link between two ranks."""
REDUCE_BYTES = 64 * 2**20
"""The most bytes an all-reduce measurement moves (a stage's gradients, up to this)."""

Measured = tuple[
    list[BlockCost], list[dict[int, float]], float, tuple[float, float, float], float, str
]


def measure(
    blocks: Sequence[nn.Module],
    world: Membership,
    device: torch.device,
    example_input: Batch,
    n_microbatches: int,
    pipeline_ranks: Sequence[int],
    machine: Measured | None = None,
) -> Measured:
    """Rank 0's block profile and W table; the contention and the link of all ranks
    (latency, bandwidth, the sender's time per message; collective); the
    all-reduce bandwidth where the group holds several copies of the pipeline
    (``inf`` otherwise); what went wrong on rank 0 while profiling (``""`` if
    nothing).

    The link is the one between the first two of ``pipeline_ranks`` (the group
    ranks of one copy of the pipeline, by pipeline rank): two stages that
    exchange activations, not two copies of the pipeline that only reduce
    gradients. The all-reduce runs over the whole group, on about one stage's
    gradients (the model's parameter bytes over the pipeline's ranks).

    With ``machine`` (the measurement of another micro-batch size), only the
    blocks are profiled again: the contention, the link and the all-reduce
    are taken from it. The random state is left as found.
    """
    homes = [device_of(b) for b in blocks]
    moved = [b.to(device) for b in blocks]
    example = to_device(example_input, device)
    figures: list[BlockCost] = []
    tables: list[dict[int, float]] = []
    problem = ""
    # The profile runs the blocks (dropout draws): the random state is left as found.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            if world.rank == 0:
                try:
                    figures, tables = _profile_rounds(moved, example, n_microbatches)
                except Exception as exc:  # the other ranks must hear of it, not wait
                    problem = f"profiling the blocks on rank 0 failed: {type(exc).__name__}: {exc}"
            # The others must learn that rank 0 failed before they wait for it below.
            shared: list[Any] = [problem, max((c.output_bytes for c in figures), default=0)]
            if world.group is not None:
                dist.broadcast_object_list(shared, src=world.global_rank(0), group=world.group)
            problem = str(shared[0])
            if problem:
                return figures, tables, 1.0, (0.0, math.inf, 0.0), math.inf, problem
            if machine is not None:
                return figures, tables, machine[2], machine[3], machine[4], problem
            contention = _contention(moved, example, world)
            link = _link(world, pipeline_ranks[:2], device, int(shared[1]))
            reduce_bandwidth = math.inf
            if world.size > len(pipeline_ranks):
                stage = stage_gradient_bytes(moved, len(pipeline_ranks))
                reduce_bandwidth = allreduce_speed(world, device, stage)
        finally:
            for block, home in zip(blocks, homes, strict=True):
                block.to(home)
    return figures, tables, contention, link, reduce_bandwidth, problem


def _profile_rounds(
    blocks: Sequence[nn.Module], example: Batch, n_microbatches: int
) -> tuple[list[BlockCost], list[dict[int, float]]]:
    """Every block's costs and W table, the median of :data:`PROFILE_ROUNDS` rounds.

    Each round times every block once, so a change of load on a shared
    machine touches all blocks alike instead of those profiled at the time.
    """
    counts = sorted({1, 2, 4, n_microbatches} & set(range(1, n_microbatches + 1)))
    rounds = [
        (
            profile_blocks(blocks, example, repeats=1),
            weight_group_times(blocks, example, counts),
        )
        for _ in range(PROFILE_ROUNDS)
    ]
    figures = [
        replace(
            first,
            **{
                name: statistics.median(getattr(r[0][i], name) for r in rounds)
                for name in (
                    "forward",
                    "forward_full",
                    "backward_input",
                    "backward_weight",
                    "backward_full",
                )
            },
        )
        for i, first in enumerate(rounds[0][0])
    ]
    tables = [
        {k: statistics.median(r[1][i][k] for r in rounds) for k in counts}
        for i in range(len(figures))
    ]
    return figures, tables


def _contention(blocks: Sequence[nn.Module], example: Batch, world: Membership) -> float:
    """How many times longer all ranks take for the same F and B at once than each alone.

    In each of :data:`CONTENTION_ROUNDS` rounds every rank runs the work alone
    in turn (the others wait at a barrier, which does not compute) and then
    all run it at once; the ratio of each round is taken under the same
    outside load, and the median over rounds and ranks is kept. It is at
    most the number of ranks on this machine: sharing it evenly, they cannot
    slow each other down more than that.
    """
    if world.group is None or world.size < 2:
        return 1.0
    group = world.group
    # CUDA runs asynchronously: the clock waits for the blocks' device.
    clock = synchronizer([p for block in blocks for p in block.parameters()])

    def work() -> float:
        start = clock()
        x = example
        for block in blocks:
            x = block(x)
        tensors = x if isinstance(x, tuple) else (x,)
        sums = [t.float().sum() for t in tensors if t.requires_grad]
        if sums:
            torch.autograd.backward(torch.stack(sums).sum())
        return clock() - start

    ratios = []
    # The runs train: they leave the user's gradients and running statistics as they were.
    with ExitStack() as stack:
        for block in blocks:
            stack.enter_context(restored(block))
        work()  # warm-up, all at once
        for _ in range(CONTENTION_ROUNDS):
            alone = 0.0
            for turn in range(world.size):
                dist.barrier(group=group)
                if world.rank == turn:
                    alone = work()
                dist.barrier(group=group)
            ratios.append(work() / alone if alone > 0 else 1.0)
    ratio = float(statistics.median_low(r for rs in all_gather_objects(world, ratios) for r in rs))
    return min(float(world.local_size), max(1.0, ratio))


def link_speed(
    world: Membership, peers: tuple[int, int], device: torch.device, nbytes: int
) -> tuple[float, float]:
    """One-way latency and bandwidth between two ranks, by ping-pong. Collective.

    The two ranks send a small message and one of ``nbytes`` back and forth
    :data:`LINK_REPEATS` times each; the others wait. Every rank returns the
    figures of ``peers[0]``.

    Args:
        world: the group.
        peers: the two group ranks of the link.
        device: where the messages live.
        nbytes: the size of the large message (a stage boundary's activation).

    Returns:
        ``(latency, bandwidth)``: seconds of the small message one way, and bytes
        per second beyond it (``inf`` if not measurable); ``(0, inf)`` without a group.
    """
    if world.group is None or world.size < 2:
        return 0.0, math.inf
    small = _one_way(world, peers, torch.zeros(2, device=device))
    large = _one_way(world, peers, torch.zeros(max(2, nbytes // 4), device=device))
    extra = large - small
    bandwidth = (nbytes - 8) / extra if extra > 0 and nbytes > 8 else math.inf
    return small, bandwidth


def allreduce_speed(
    world: Membership,
    device: torch.device,
    nbytes: int,
    timed: Callable[[Membership, torch.Tensor], float] | None = None,
) -> float:
    """Bytes per second each rank of a ring all-reduce over ``world`` moves. Collective.

    Every rank all-reduces a small tensor and one of ``nbytes``,
    :data:`LINK_REPEATS` times each; the difference of the two median times is
    solved for the bandwidth of :func:`twobp.sim.costs.allreduce_time`
    (``2 (n - 1)`` steps of ``nbytes / n``). On CPU ranks this is well below
    a point-to-point message's bandwidth: the ranks also sum and copy. The
    figure of the group's rank 0 is returned on every rank.

    Args:
        world: the group whose ranks reduce together.
        device: where the tensors live.
        nbytes: the size of the large all-reduce (a stage's gradients).
        timed: the seconds an all-reduce of a tensor takes over ``world``, the
            same on every rank (collective); None: its median, measured.

    Returns:
        Bytes per second (``inf`` without a group of two ranks, or if not measurable).
    """
    return allreduce_link(world, device, nbytes, timed)[1]


def allreduce_link(
    world: Membership,
    device: torch.device,
    nbytes: int,
    timed: Callable[[Membership, torch.Tensor], float] | None = None,
) -> tuple[float, float]:
    """The latency per ring step and the bandwidth of an all-reduce over ``world``, as
    :func:`allreduce_speed` measures them (the latency: a small all-reduce's time over its
    ``2 (n - 1)`` steps). Collective.

    Returns:
        Seconds and bytes per second (``0.0, inf`` without a group of two ranks; ``inf``
        bandwidth if not measurable).
    """
    if world.group is None or world.size < 2:
        return 0.0, math.inf
    timed = _allreduce_time if timed is None else timed
    small = timed(world, torch.zeros(2, device=device))
    large = timed(world, torch.zeros(max(2, nbytes // 4), device=device))
    steps = 2 * (world.size - 1)
    extra = large - small
    if extra <= 0 or nbytes <= 8:
        return small / steps, math.inf
    return small / steps, steps * (nbytes - 8) / (world.size * extra)


def stage_gradient_bytes(blocks: Sequence[nn.Module], n_stages: int) -> int:
    """About one stage's gradient bytes, the size to measure an all-reduce on: the
    model's parameter bytes over ``n_stages``, between 4 MiB (smaller all-reduces
    are mostly latency, too noisy to tell a bandwidth) and :data:`REDUCE_BYTES`."""
    total = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    return int(min(REDUCE_BYTES, max(4 * 2**20, total // max(1, n_stages))))


def _allreduce_time(world: Membership, tensor: torch.Tensor) -> float:
    """The median time of an all-reduce of ``tensor`` over ``world``, rank 0's on every rank."""
    group = world.group
    times = []
    dist.all_reduce(tensor, group=group)
    for _ in range(LINK_REPEATS):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        times.append(time.perf_counter() - start)
        tensor.zero_()
    return _shared(world, statistics.median(times), 0, tensor.device)


def _one_way(world: Membership, peers: tuple[int, int], message: torch.Tensor) -> float:
    """The median one-way time of ``message`` between ``peers``, on every rank."""
    group = world.group
    first, second = (world.global_rank(r) for r in peers)
    dist.barrier(group=group)
    times = []
    for _ in range(LINK_REPEATS):
        start = time.perf_counter()
        if world.rank == peers[0]:
            dist.send(message, second, group=group)
            dist.recv(message, second, group=group)
        elif world.rank == peers[1]:
            dist.recv(message, first, group=group)
            dist.send(message, first, group=group)
        times.append((time.perf_counter() - start) / 2)
    return _shared(world, statistics.median(times), peers[0], message.device)


def _link(
    world: Membership, ranks: Sequence[int], device: torch.device, nbytes: int
) -> tuple[float, float, float]:
    """One-way latency and bandwidth between the two ``ranks`` (:func:`link_speed`), and
    the first's time to post a message of ``nbytes`` while the second computes; on every
    rank. Nothing to measure with fewer than two."""
    if world.group is None or len(ranks) < 2:
        return 0.0, math.inf, 0.0
    peers = (ranks[0], ranks[1])
    latency, bandwidth = link_speed(world, peers, device, nbytes)
    message = torch.zeros(max(2, nbytes // 4), device=device)
    overhead = _posting(world, peers, message) if world.backend == "gloo" else 0.0
    return latency, bandwidth, overhead


def _posting(world: Membership, peers: tuple[int, int], message: torch.Tensor) -> float:
    """The median time ``peers[0]`` is held posting ``message`` while ``peers[1]`` computes."""
    group = world.group
    first, second = (world.global_rank(r) for r in peers)
    times = []
    busy = torch.ones(128, 128, device=message.device)
    for _ in range(LINK_REPEATS):
        work = None
        if world.rank == peers[1]:
            work = dist.irecv(message, first, group=group)
        dist.barrier(group=group)
        if world.rank == peers[0]:
            start = time.perf_counter()
            work = dist.isend(message, second, group=group)
            times.append(time.perf_counter() - start)
        elif world.rank == peers[1]:
            for _ in range(8):
                busy = (busy @ busy) / 128.0
        if work is not None:
            work.wait()
    figure = statistics.median(times) if times else 0.0
    return _shared(world, figure, peers[0], message.device)


def _shared(world: Membership, figure: float, source: int, device: torch.device) -> float:
    """``figure`` as group rank ``source`` measured it, on every rank."""
    shared = torch.tensor([figure], dtype=torch.float64, device=device)
    dist.broadcast(shared, world.global_rank(source), group=world.group)
    return float(shared)
