"""``schedule="auto"``: measure the blocks, simulate every schedule, run the fastest.

Rank 0 profiles every block on one micro-batch (F, I, W, the fused B, the
bytes kept, and W over 1, 2, 4 and ``m`` micro-batches at once), alone while
the other ranks wait; then all ranks measure together how much slower they
compute at once than alone (the contention of ranks sharing a machine). Rank
0 simulates every schedule, 2BP policy, W group cap and number of stages per
rank (:mod:`twobp.sim.search`) under those costs, takes the fastest whose
peak memory fits ``memory_limit``, and sends its schedule and partition to
every rank, so that all run the same one whatever their own timings. With a
cost model given (``costs=``), nothing is measured.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.partition.profiler import BlockCost, profile_blocks, solver_costs, weight_group_times
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import Batch, to_device
from twobp.runtime.setup.group import Membership
from twobp.schedule import SCHEDULES, Schedule
from twobp.sim.cost_io import format_amount, parse_amount
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor, SizesFor, partition_for, profiled_costs
from twobp.sim.planner import ALL_POLICIES, NO_TWO_BP, Candidate
from twobp.sim.search import (
    NothingFitsError,
    Option,
    choose,
    describe,
    options,
    search,
    simulate_option,
)

AUTO = "auto"
"""The schedule name that asks the pipeline to choose."""
PARAMETER_FACTOR = 2.0
"""Bytes counted per parameter byte against ``memory_limit``: the weights and their gradients."""
SHOWN = 10
"""Candidates :meth:`AutoPlan.table` lists."""
CONTENTION_ROUNDS = 5
"""Rounds of alone and together runs the contention is the median of."""
LINK_REPEATS = 20
"""Ping-pongs per message size when measuring the link between ranks 0 and 1."""

log = logging.getLogger("twobp")


@dataclass(frozen=True)
class AutoPlan:
    """What ``schedule="auto"`` chose, and the ranking it chose from.

    Args:
        choice: the candidate that runs (its ``makespan`` is the predicted step time).
        ranking: every candidate: those within the memory limit fastest first,
            then those over it, then those that could not be built.
        schedule: the compute schedule of the choice, W placed.
        partition: blocks per stage.
        costs: the cost model of the choice's stages (seconds and bytes).
        memory_limit: the limit per rank in bytes, or None.
    """

    choice: Candidate
    ranking: tuple[Candidate, ...]
    schedule: Schedule
    partition: tuple[int, ...]
    costs: CostModel
    memory_limit: float | None

    @property
    def predicted_step_time(self) -> float:
        """The simulated step time of the choice (the cost model's unit: seconds when measured)."""
        return self.choice.makespan

    def summary(self) -> str:
        """One line: what runs and the predicted step time."""
        limit = "" if self.memory_limit is None else f", limit {format_amount(self.memory_limit)}"
        return (
            f"schedule='auto' chose {describe(self.choice)}: predicted step "
            f"{self.predicted_step_time * 1e3:.4g} ms, peak memory "
            f"{format_amount(self.choice.peak_memory)} per rank{limit}; partition "
            f"{list(self.partition)}; best of {sum(c.ok for c in self.ranking)} simulated "
            f"(contention {self.costs.contention:.2f})"
        )

    def table(self, rows: int = SHOWN) -> str:
        """The fastest ``rows`` candidates: step time, against the choice (``*``), bubble
        and memory."""
        lines = [f"{'#':>4}  {'candidate':<52} {'step ms':>9} {'vs best':>8} {'bubble':>7} memory"]
        for i, c in enumerate([c for c in self.ranking if c.ok][:rows], 1):
            over = self.memory_limit is not None and c.peak_memory > self.memory_limit
            mark = "*" if c == self.choice else " "
            lines.append(
                f"{mark}{i:>3}  {describe(c):<52} {c.makespan * 1e3:9.4g} "
                f"{c.makespan / self.choice.makespan:7.2f}x {c.bubble_ratio:7.1%} "
                f"{format_amount(c.peak_memory)}{' (over the limit)' if over else ''}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"{self.summary()}\n{self.table()}"


def read_memory_limit(memory_limit: float | str | None) -> float | None:
    """The ``memory_limit`` argument in bytes.

    Raises:
        PipelineConfigError: if it is not a positive amount.
    """
    if memory_limit is None:
        return None
    try:
        value = parse_amount(memory_limit) if isinstance(memory_limit, str) else float(memory_limit)
    except ValueError as exc:
        raise PipelineConfigError(f"memory_limit={memory_limit!r}: {exc}") from None
    if not value > 0:
        raise PipelineConfigError(
            f"memory_limit={memory_limit!r}: give a positive number of bytes per rank, or a "
            "size such as '2GiB'"
        )
    return value


def plan_auto(
    blocks: Sequence[nn.Module],
    world: Membership,
    device: torch.device,
    *,
    n_microbatches: int,
    two_bp: bool,
    stages_per_rank: int | None,
    partition: Sequence[int] | str | None,
    example_input: Batch | None,
    memory_limit: float | None,
    costs: CostModel | None,
    schedules: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
) -> AutoPlan:
    """Choose the schedule, the same on every rank. Collective: every rank calls it.

    Args:
        blocks: the whole model's blocks.
        world: the group.
        device: where rank 0 profiles the blocks.
        n_microbatches: micro-batches per step.
        two_bp: False tries only fused schedules without 2BP.
        stages_per_rank: only this many stages per rank, or None for any.
        partition: blocks per stage (only schedules with that many stages
            are tried), ``"uniform"``, or ``"balanced"`` (by the profile);
            None: balanced if the blocks are profiled, else uniform.
        example_input: one micro-batch of model inputs (needed unless ``costs``).
        memory_limit: bytes per rank, or None.
        costs: a cost model to plan with instead of measuring.
        schedules: the schedules to try (None: every one).
        policies: the 2BP policies to try (None: every one, or ``off`` without 2BP).

    Returns:
        The plan, identical on every rank.

    Raises:
        PipelineConfigError: on every rank, if the input is missing, nothing
            fits the memory limit (saying what the least needs) or nothing
            can be built.
    """
    answer: list[AutoPlan | str | None] = [None]
    if costs is None:
        if example_input is None:
            raise PipelineConfigError(
                "schedule='auto' (and costs='profile') profile the blocks and need "
                "example_input=<one micro-batch of model inputs>; pass it, or a cost model "
                "as costs="
            )
        measured = _measure(blocks, world, device, example_input, n_microbatches)
    if world.rank == 0:
        try:
            if costs is None:
                figures, tables, contention, link, problem = measured
                if problem:
                    raise PipelineConfigError(problem)
                # Measured, the blocks split by their costs unless the caller chose.
                chosen = "balanced" if partition is None else partition
                sizes_for = partition_for(len(figures), chosen, solver_costs(figures))
                costs_for = profiled_costs(
                    figures,
                    tables,
                    sizes_for,
                    contention=contention,
                    parameter_factor=PARAMETER_FACTOR,
                    send_latency=link[0],
                    bandwidth=link[1],
                )
            else:
                if partition == "balanced":
                    raise PipelineConfigError(
                        "with costs= nothing is profiled, so partition='balanced' has nothing "
                        "to balance; give block counts or 'uniform'"
                    )
                sizes_for, costs_for = partition_for(len(blocks), partition, None), costs.for_stages
            names = [
                n
                for n, info in SCHEDULES.items()
                if (schedules is None or n in schedules) and (two_bp or not info.natively_split)
            ]
            tried = policies or (ALL_POLICIES if two_bp else (NO_TWO_BP,))
            choices = [
                o
                for o in options(n_microbatches, schedules=names, policies=tried)
                if stages_per_rank is None or o.stages_per_rank == stages_per_rank
            ]
            answer[0] = _choose(
                choices, costs_for, sizes_for, world.size, n_microbatches, memory_limit
            )
        except (ValueError, PipelineConfigError) as exc:
            answer[0] = f"schedule='auto': {exc}"
    if world.group is not None:
        dist.broadcast_object_list(answer, src=world.global_rank(0), group=world.group)
    plan = answer[0]
    if not isinstance(plan, AutoPlan):
        raise PipelineConfigError(str(plan))
    if world.rank == 0:
        log.info("%s", plan.summary())
    return plan


def _choose(
    choices: Sequence[Option],
    costs_for: CostsFor,
    sizes_for: SizesFor,
    n_ranks: int,
    n_microbatches: int,
    memory_limit: float | None,
) -> AutoPlan:
    def fitted(n_stages: int) -> CostModel:
        sizes_for(n_stages)  # raises if the blocks do not split into n_stages
        return costs_for(n_stages)

    ranking = search(choices, n_ranks, n_microbatches, fitted, memory_limit)
    try:
        best = choose(ranking, memory_limit)
    except NothingFitsError as exc:
        raise PipelineConfigError(str(exc)) from None
    option = next(o for o in choices if _same(o, best))
    candidate, schedule = simulate_option(option, n_ranks, n_microbatches, fitted, memory_limit)
    assert schedule is not None and candidate == best
    return AutoPlan(
        best,
        tuple(ranking),
        schedule,
        sizes_for(schedule.n_stages),
        costs_for(schedule.n_stages),
        memory_limit,
    )


def _same(option: Option, c: Candidate) -> bool:
    return (option.schedule, option.policy, option.stages_per_rank, option.group_size) == (
        c.schedule,
        c.policy,
        c.stages_per_rank,
        c.group_size,
    )


Measured = tuple[list[BlockCost], list[dict[int, float]], float, tuple[float, float], str]


def _measure(
    blocks: Sequence[nn.Module],
    world: Membership,
    device: torch.device,
    example_input: Batch,
    n_microbatches: int,
) -> Measured:
    """Rank 0's block profile and W table; the contention and the link of all ranks
    (collective); what went wrong on rank 0 while profiling (``""`` if nothing)."""
    homes = [_device_of(b) for b in blocks]
    moved = [b.to(device) for b in blocks]
    example = to_device(example_input, device)
    figures: list[BlockCost] = []
    tables: list[dict[int, float]] = []
    problem = ""
    try:
        if world.rank == 0:
            try:
                figures = profile_blocks(moved, example, repeats=3)
                counts = sorted({1, 2, 4, n_microbatches} & set(range(1, n_microbatches + 1)))
                tables = weight_group_times(moved, example, counts, repeats=3)
            except Exception as exc:  # the other ranks must hear of it, not wait
                problem = f"profiling the blocks on rank 0 failed: {type(exc).__name__}: {exc}"
        # The others must learn that rank 0 failed before they wait for it below.
        shared: list[Any] = [problem, max((c.output_bytes for c in figures), default=0)]
        if world.group is not None:
            dist.broadcast_object_list(shared, src=world.global_rank(0), group=world.group)
        problem = str(shared[0])
        if problem:
            return figures, tables, 1.0, (0.0, math.inf), problem
        contention = _contention(moved, example, world)
        link = _link(world, device, int(shared[1]))
    finally:
        for block, home in zip(blocks, homes, strict=True):
            block.to(home)
    return figures, tables, contention, link, problem


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

    def work() -> float:
        start = time.perf_counter()
        x = example
        for block in blocks:
            x = block(x)
        tensors = x if isinstance(x, tuple) else (x,)
        sums = [t.float().sum() for t in tensors if t.requires_grad]
        if sums:
            torch.autograd.backward(torch.stack(sums).sum())
        return time.perf_counter() - start

    grads = [(p, p.grad) for b in blocks for p in b.parameters()]
    work()  # warm-up, all at once
    ratios = []
    for _ in range(CONTENTION_ROUNDS):
        alone = 0.0
        for turn in range(world.size):
            dist.barrier(group=group)
            if world.rank == turn:
                alone = work()
            dist.barrier(group=group)
        ratios.append(work() / alone if alone > 0 else 1.0)
    for p, g in grads:
        p.grad = g
    gathered = torch.zeros(world.size * CONTENTION_ROUNDS, dtype=torch.float64)
    mine = torch.tensor(ratios, dtype=torch.float64)
    if world.backend == "nccl":
        gathered, mine = gathered.cuda(), mine.cuda()
    dist.all_gather(list(gathered.chunk(world.size)), mine, group=group)
    ratio = float(gathered.median())
    return min(float(world.local_size), max(1.0, ratio))


def _link(world: Membership, device: torch.device, nbytes: int) -> tuple[float, float]:
    """One-way latency and bandwidth between ranks 0 and 1 (ping-pong), on every rank."""
    if world.group is None or world.size < 2:
        return 0.0, math.inf
    group = world.group
    peers = (world.global_rank(0), world.global_rank(1))

    def one_way(message: torch.Tensor) -> float:
        dist.barrier(group=group)
        times = []
        for _ in range(LINK_REPEATS):
            start = time.perf_counter()
            if world.rank == 0:
                dist.send(message, peers[1], group=group)
                dist.recv(message, peers[1], group=group)
            elif world.rank == 1:
                dist.recv(message, peers[0], group=group)
                dist.send(message, peers[0], group=group)
            times.append((time.perf_counter() - start) / 2)
        shared = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
        dist.broadcast(shared, peers[0], group=group)
        return float(shared)

    small = one_way(torch.zeros(2, device=device))
    large = one_way(torch.zeros(max(2, nbytes // 4), device=device))
    extra = large - small
    return small, (nbytes - 8) / extra if extra > 0 and nbytes > 8 else math.inf


def _device_of(block: nn.Module) -> torch.device:
    for tensor in block.parameters():
        return tensor.device
    return torch.device("cpu")
