"""``schedule="auto"``: measure the blocks, simulate every schedule, run the fastest.

Rank 0 profiles every block on one micro-batch (F, I, W, the fused B, the
bytes kept, and W over 1, 2, 4 and ``m`` micro-batches at once), alone while
the other ranks wait; then all ranks measure together how much slower they
compute at once than alone (the contention of ranks sharing a machine) and
the link between ranks (:mod:`twobp.runtime.setup.cost_measurement`). Rank
0 simulates every schedule, 2BP policy, W group cap and number of stages per
rank (:mod:`twobp.sim.search`) under those costs, takes the fastest whose
peak memory fits ``memory_limit``, and sends its schedule and partition to
every rank, so that all run the same one whatever their own timings. With a
cost model given (``costs=``), nothing is measured.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from twobp.partition.profiler import solver_costs
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import Batch
from twobp.runtime.setup.cost_measurement import measure
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


def profiling_input(example_input: Batch | None) -> Batch:
    """The example input the blocks are profiled on.

    Raises:
        PipelineConfigError: if it is None.
    """
    if example_input is None:
        raise PipelineConfigError(
            "schedule='auto' (and costs='profile') profile the blocks and need "
            "example_input=<one micro-batch of model inputs>; pass it, or a cost model "
            "as costs="
        )
    return example_input


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
    pipeline_ranks: Sequence[int] | None = None,
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
        pipeline_ranks: the group ranks of the first copy of the pipeline, by
            pipeline rank (None: the whole group); the link is measured between
            its first two.

    Returns:
        The plan, identical on every rank.

    Raises:
        PipelineConfigError: on every rank, if nothing fits the memory limit
            (saying what the least needs) or nothing can be built; on this rank
            if the input is missing (:func:`twobp.runtime.setup.pipeline_plan.plan_pipeline`
            checks it on every rank first).
    """
    answer: list[AutoPlan | str | None] = [None]
    ranks = list(range(world.size)) if pipeline_ranks is None else list(pipeline_ranks)
    if costs is None:
        example_input = profiling_input(example_input)
        measured = measure(blocks, world, device, example_input, n_microbatches, ranks)
    if world.rank == 0:
        try:
            if costs is None:
                figures, tables, contention, link, reduce_bandwidth, problem = measured
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
                    send_overhead=link[2],
                    reduce_bandwidth=None if math.isinf(reduce_bandwidth) else reduce_bandwidth,
                )
            else:
                if partition == "balanced":
                    raise PipelineConfigError(
                        "with costs= nothing is profiled, so partition='balanced' has nothing "
                        "to balance; give block counts or 'uniform'"
                    )
                sizes_for, costs_for = partition_for(len(blocks), partition, None), costs.for_stages
            # One pipeline per schedule: the search cuts the model into the schedule's stages.
            names = [
                n
                for n, info in SCHEDULES.items()
                if (schedules is None or n in schedules)
                and (two_bp or not info.natively_split)
                and info.pipelines == 1
            ]
            tried = policies or (ALL_POLICIES if two_bp else (NO_TWO_BP,))
            choices = [
                o
                for o in options(n_microbatches, schedules=names, policies=tried)
                if stages_per_rank is None or o.stages_per_rank == stages_per_rank
            ]
            answer[0] = _choose(
                choices,
                costs_for,
                sizes_for,
                len(ranks),
                n_microbatches,
                memory_limit,
                max(1, world.size // len(ranks)),
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
    data_parallel: int = 1,
) -> AutoPlan:
    def fitted(n_stages: int) -> CostModel:
        sizes_for(n_stages)  # raises if the blocks do not split into n_stages
        return costs_for(n_stages)

    ranking = search(choices, n_ranks, n_microbatches, fitted, memory_limit, data_parallel)
    try:
        best = choose(ranking, memory_limit)
    except NothingFitsError as exc:
        raise PipelineConfigError(str(exc)) from None
    option = next(o for o in choices if _same(o, best))
    candidate, schedule = simulate_option(
        option, n_ranks, n_microbatches, fitted, memory_limit, data_parallel
    )
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
