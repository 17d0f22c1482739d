"""``schedule="auto"``: measure the blocks, simulate every schedule, run the fastest.

Rank 0 profiles every block on one micro-batch (F, I, W, the fused B, the
bytes kept, and W over 1, 2, 4 and ``m`` micro-batches at once), alone while
the other ranks wait; then all ranks measure together how much slower they
compute at once than alone (the contention of ranks sharing a machine) and
the link between ranks (:mod:`twobp.runtime.setup.auto.cost_measurement`). Rank
0 simulates every schedule, 2BP policy, W group cap and number of stages per
rank (:mod:`twobp.sim.search`) under those costs, takes the fastest whose
peak memory fits ``memory_limit``, and sends its schedule and partition to
every rank, so that all run the same one whatever their own timings. With it
go the *contenders*: the fastest simulated candidate of each other schedule
and stage count, up to ``contenders`` in all, that trial steps
(:mod:`twobp.runtime.setup.auto.trials`) measure before the pipeline settles.
With a cost model given (``costs=``), nothing is measured.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from twobp.partition.profiler import solver_costs
from twobp.runtime.base.group import Membership
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import AUTO as AUTO
from twobp.runtime.options import CONTENDERS as CONTENDERS
from twobp.runtime.options import Batch
from twobp.runtime.setup.auto.cost_measurement import Measured, measure
from twobp.runtime.setup.decide import decided_on_rank_0
from twobp.schedule import Schedule
from twobp.sim.cost_io import format_amount, parse_amount
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import (
    CostsFor,
    SizesFor,
    partition_for,
    profiled_costs,
    with_optimizer_state,
)
from twobp.sim.planner import NO_TWO_BP, Candidate
from twobp.sim.recompute import NO_RECOMPUTE
from twobp.sim.search import (
    NothingFitsError,
    Option,
    auto_options,
    choose,
    describe,
    fits,
    rank,
    search,
    simulate_option,
)

PARAMETER_FACTOR = 2.0
"""Bytes counted per parameter byte against ``memory_limit``: the weights and their gradients."""
SHOWN = 10
"""Candidates :meth:`AutoPlan.table` lists."""
CONTENDER_WINDOW = 0.25
"""How much slower than the choice a simulated step may be for its schedule to contend."""

log = logging.getLogger("twobp")


@dataclass(frozen=True)
class OptimizerMemory:
    """The optimizer state ``schedule="auto"`` counts against ``memory_limit``.

    Args:
        state_bytes: bytes of optimizer state per parameter (AdamW in float32:
            8; with float32 masters of half-precision parameters: 12); 0: not
            counted (a given cost model's ``optimizer_bytes`` stay).
        sharded: the optimizer will be ``pipe.shard_optimizer``'s: each holder
            of a stage counts its share, and ``R`` and the gathers are timed
            as they run (``CostModel.shard_optimizer``).
        parameters_sharded: the parameters and gradients will be sharded too
            (``shard_parameters=True``): each holder of a stage counts its share of
            them, and the stage's whole weights while its step reads them
            (``CostModel.shard_parameters``, ``gathered_bytes``).
    """

    state_bytes: float = 0.0
    sharded: bool = False
    parameters_sharded: bool = False

    def counted(
        self, costs_for: CostsFor, sizes_for: SizesFor, blocks: Sequence[nn.Module]
    ) -> CostsFor:
        """``costs_for`` with this state added to every stage's memory."""
        return with_optimizer_state(
            costs_for,
            sizes_for,
            [sum(p.numel() for p in b.parameters()) for b in blocks],
            self.state_bytes,
            self.sharded,
            1 / PARAMETER_FACTOR if self.parameters_sharded else None,
        )


@dataclass(frozen=True)
class Contender:
    """A simulated candidate, built: what a pipeline runs if it is chosen.

    Args:
        candidate: the simulated candidate.
        schedule: its compute schedule, W placed.
        partition: blocks per stage.
        costs: the cost model of its stages.
    """

    candidate: Candidate
    schedule: Schedule
    partition: tuple[int, ...]
    costs: CostModel


@dataclass(frozen=True)
class SizeTried:
    """A tensor-parallel size ``schedule="auto"`` searched (``tensor_parallel=(1, 2, ...)``).

    Args:
        size: the tensor-parallel ranks ``T``.
        pipeline: the pipeline ranks ``P`` it leaves (world / (D x T)).
        step: the simulated step of its fastest candidate that fits, or None.
        why_not: why it was not searched or nothing of it fits; "" if it was.
    """

    size: int
    pipeline: int
    step: float | None = None
    why_not: str = ""

    def __str__(self) -> str:
        at = f"T={self.size}" + (f" (P={self.pipeline})" if self.pipeline else "")
        if self.step is None:
            return f"{at}: {self.why_not}"
        return f"{at} {self.step * 1e3:.4g} ms"


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
        contenders: the schedules trial steps measure before the pipeline
            settles: the simulator's choice first, then the fastest simulated
            candidate of each other schedule, stage count and 2BP or not,
            fastest first (distinct schedules only, each within
            :data:`CONTENDER_WINDOW` of the choice); empty without trials.
        trial_times: the measured step time of each contender in seconds (the
            slowest rank's median over the rounds it ran; ``inf`` if it
            failed), empty until the trials ran. The choice is the fastest.
        tensor_sizes: with a range of ``tensor_parallel`` sizes, every size searched
            and its simulated step, in the order given; empty otherwise.
        tensor_parallel: the tensor-parallel size the choice runs at.
    """

    choice: Candidate
    ranking: tuple[Candidate, ...]
    schedule: Schedule
    partition: tuple[int, ...]
    costs: CostModel
    memory_limit: float | None
    contenders: tuple[Contender, ...] = ()
    trial_times: tuple[float, ...] = ()
    tensor_sizes: tuple[SizeTried, ...] = ()
    tensor_parallel: int = 1

    def settled(self, trial_times: Sequence[float]) -> AutoPlan:
        """The plan of the contender the trial steps measured fastest.

        Args:
            trial_times: the measured step time of each contender (``inf``: failed).

        Returns:
            This plan with the fastest finite contender as its choice and the
            times kept; the simulator's choice if none ran.
        """
        if len(trial_times) != len(self.contenders):
            raise ValueError(
                f"{len(trial_times)} trial times for {len(self.contenders)} contenders"
            )
        finite = [i for i, t in enumerate(trial_times) if math.isfinite(t)]
        if not finite:
            return replace(self, trial_times=tuple(trial_times))
        best = self.contenders[min(finite, key=lambda i: trial_times[i])]
        return replace(
            self,
            choice=best.candidate,
            schedule=best.schedule,
            partition=best.partition,
            costs=best.costs,
            trial_times=tuple(trial_times),
        )

    def trial_time(self, candidate: Candidate) -> float | None:
        """The measured step time of a candidate in the trial steps, or None if not tried."""
        for contender, t in zip(self.contenders, self.trial_times, strict=False):
            if contender.candidate == candidate:
                return t
        return None

    @property
    def predicted_step_time(self) -> float:
        """The simulated step time of the choice (the cost model's unit: seconds when measured)."""
        return self.choice.makespan

    def summary(self) -> str:
        """One line: what runs, the predicted (and measured) step time."""
        limit = "" if self.memory_limit is None else f", limit {format_amount(self.memory_limit)}"
        measured = self.trial_time(self.choice)
        tried = sum(math.isfinite(t) for t in self.trial_times)
        trials = (
            ""
            if measured is None or not math.isfinite(measured)
            else f", measured {measured * 1e3:.4g} ms in trial steps, the fastest of {tried} tried"
        )
        sizes = ""
        if self.tensor_sizes:
            sizes = (
                f"; tensor_parallel={self.tensor_parallel}, the fastest simulated of "
                + ", ".join(str(s) for s in self.tensor_sizes)
            )
        return (
            f"schedule='auto' chose {describe(self.choice)}: predicted step "
            f"{self.predicted_step_time * 1e3:.4g} ms{trials}, peak memory "
            f"{format_amount(self.choice.peak_memory)} per rank{limit}; partition "
            f"{list(self.partition)}; best of {sum(c.ok for c in self.ranking)} simulated "
            f"(contention {self.costs.contention:.2f}){sizes}"
        )

    def table(self, rows: int = SHOWN) -> str:
        """The fastest ``rows`` candidates and the contenders: step time, against the
        fastest simulated, bubble, memory, and the step time measured in the trial steps
        of those tried; ``*`` marks what runs."""
        ran = [c for c in self.ranking if c.ok]
        best = min(c.makespan for c in ran)
        shown = ran[:rows] + [c.candidate for c in self.contenders if c.candidate not in ran[:rows]]
        width = max(52, *(len(describe(c)) for c in shown))
        lines = [
            f"{'#':>4}  {'candidate':<{width}} {'step ms':>9} {'vs best':>8} {'bubble':>7} "
            f"{'memory':<10} {'trial ms':>8}"
        ]
        for c in shown:
            over = self.memory_limit is not None and c.peak_memory > self.memory_limit
            mark = "*" if c == self.choice else " "
            tried = self.trial_time(c)
            trial = "" if tried is None else "failed" if math.isinf(tried) else f"{tried * 1e3:.4g}"
            line = (
                f"{mark}{ran.index(c) + 1:>3}  {describe(c):<{width}} {c.makespan * 1e3:9.4g} "
                f"{c.makespan / best:7.2f}x {c.bubble_ratio:7.1%} "
                f"{format_amount(c.peak_memory):<10} {trial:>8}"
                f"{' (over the limit)' if over else ''}"
            )
            lines.append(line.rstrip())
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
    n_microbatches: int | Sequence[int],
    two_bp: bool,
    stages_per_rank: int | None,
    partition: Sequence[int] | str | None,
    example_input: Batch | None,
    memory_limit: float | None,
    costs: CostModel | None,
    schedules: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    pipeline_ranks: Sequence[int] | None = None,
    contenders: int = 1,
    tied: bool = False,
    examples: Mapping[int, Batch] | None = None,
    recompute: str = NO_RECOMPUTE,
    optimizer: OptimizerMemory | None = None,
) -> AutoPlan:
    """Choose the schedule, the same on every rank. Collective: every rank calls it.

    Args:
        blocks, world, device: the model's blocks, the group, where rank 0 profiles.
        n_microbatches: micro-batches per step; or the counts to choose among, each
            profiled on its own micro-batch ``examples[count]`` and named by every
            candidate (:attr:`Candidate.n_microbatches`).
        two_bp: False tries only fused schedules without 2BP.
        stages_per_rank: only this many stages per rank, or None for any.
        partition: blocks per stage (only schedules with that many stages), or
            ``"uniform"``/``"balanced"``; None: balanced if profiled, else uniform.
        example_input: one micro-batch of inputs (unless ``costs`` or ``examples``).
        memory_limit: bytes per rank, or None.
        costs: a cost model to plan with instead of measuring (one count only).
        schedules, policies: the schedules and 2BP policies to try (None: every one).
        pipeline_ranks: the group ranks of the first copy, by pipeline rank
            (None: the whole group); the link is measured between its first two.
        contenders: how many schedules the plan keeps for trial steps; 1 or less: none.
        tied: some weight is used by several blocks (its stages reduce it).
        examples: one micro-batch per count of ``n_microbatches``.
        recompute: ``off``, or ``auto``: every option rebuilds the fewest stashes
            that fit ``memory_limit`` (:func:`twobp.sim.rebuild.fewest_rebuilds`).
        optimizer: the optimizer state to count, and whether it is sharded.

    Returns:
        The plan, identical on every rank.

    Raises:
        PipelineConfigError: on every rank, if nothing fits the memory limit
            (saying what the least needs) or nothing can be built.
    """
    ranks = list(range(world.size)) if pipeline_ranks is None else list(pipeline_ranks)
    chosen_count = not isinstance(n_microbatches, int)
    counts = [n_microbatches] if isinstance(n_microbatches, int) else list(n_microbatches)
    measured: dict[int, Measured] = {}
    if costs is None:
        measured = _measured(blocks, world, device, counts, ranks, example_input, examples)

    def space(m: int) -> OptionSpace:
        options = auto_options(
            m,
            two_bp=two_bp,
            schedules=schedules,
            policies=policies,
            stages_per_rank=stages_per_rank,
            recompute=recompute,
        )
        sized = costs_of(blocks, partition, costs, measured[m] if costs is None else None)
        return option_space(m, chosen_count, sized, blocks, optimizer, options)

    copies = max(1, world.size // len(ranks))
    return decided_on_rank_0(
        world,
        lambda: choose_plan(
            [space(m) for m in counts], len(ranks), memory_limit, copies, contenders, tied
        ),
        AutoPlan,
        lambda exc: f"schedule='auto': {exc}",
    )


def measured_costs(measured: Measured, sizes_for: SizesFor) -> CostsFor:
    """The cost model of the blocks cut by ``sizes_for``, from rank 0's measurements
    (weights and their gradients counted as :data:`PARAMETER_FACTOR`).

    Raises:
        PipelineConfigError: if profiling failed on rank 0.
    """
    figures, tables, contention, link, reduce_bandwidth, problem = measured
    if problem:
        raise PipelineConfigError(problem)
    return profiled_costs(
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


def option_space(
    m: int,
    chosen_count: bool,
    sized: tuple[SizesFor, CostsFor],
    blocks: Sequence[nn.Module],
    optimizer: OptimizerMemory | None,
    choices: Sequence[Option],
) -> OptionSpace:
    """The options of ``m`` micro-batches, with their costs (and optimizer state)."""
    sizes_for, costs_for = sized
    if optimizer is not None:
        costs_for = optimizer.counted(costs_for, sizes_for, blocks)
    return OptionSpace(m if chosen_count else None, m, choices, costs_for, sizes_for)


def _measured(
    blocks: Sequence[nn.Module],
    world: Membership,
    device: torch.device,
    counts: Sequence[int],
    ranks: Sequence[int],
    example_input: Batch | None,
    examples: Mapping[int, Batch] | None,
) -> dict[int, Measured]:
    """Rank 0's measurements of the blocks on a micro-batch of each count; the machine
    (contention, link) is measured once, on the first. Collective."""
    measured: dict[int, Measured] = {}
    machine: Measured | None = None
    for m in counts:
        example = examples[m] if examples is not None else profiling_input(example_input)
        measured[m] = measure(blocks, world, device, example, m, ranks, machine)
        machine = machine or measured[m]
    return measured


def costs_of(
    blocks: Sequence[nn.Module],
    partition: Sequence[int] | str | None,
    costs: CostModel | None,
    measured: Measured | None,
) -> tuple[SizesFor, CostsFor]:
    """The blocks per stage and the cost model for a number of stages: from the
    measurements (balanced by them unless the caller chose), or from ``costs``."""
    if measured is not None:
        figures = measured[0]
        chosen = "balanced" if partition is None else partition
        sizes_for = partition_for(len(figures), chosen, solver_costs(figures))
        return sizes_for, measured_costs(measured, sizes_for)
    assert costs is not None
    if partition == "balanced":
        raise PipelineConfigError(
            "with costs= nothing is profiled, so partition='balanced' has nothing "
            "to balance; give block counts or 'uniform'"
        )
    return partition_for(len(blocks), partition, None), costs.for_stages


@dataclass(frozen=True)
class OptionSpace:
    """The options of one micro-batch count and the costs they are simulated under.

    Args:
        count: the count candidates name (:attr:`Candidate.n_microbatches`), or
            None where the count is not chosen.
        n_microbatches: the micro-batches per step simulated.
        choices: the options.
        costs_for: the cost model of the model cut into a number of stages.
        sizes_for: the blocks per stage of a number of stages.
    """

    count: int | None
    n_microbatches: int
    choices: Sequence[Option]
    costs_for: CostsFor
    sizes_for: SizesFor

    def fitted(self, n_stages: int) -> CostModel:
        self.sizes_for(n_stages)  # raises if the blocks do not split into n_stages
        return self.costs_for(n_stages)


def choose_plan(
    spaces: Sequence[OptionSpace],
    n_ranks: int,
    memory_limit: float | None,
    data_parallel: int = 1,
    contenders: int = 1,
    tied: bool = False,
) -> AutoPlan:
    def built(c: Candidate) -> Contender:
        space = next(s for s in spaces if s.count == c.n_microbatches)
        option = next(o for o in space.choices if _same(o, c))
        candidate, schedule = simulate_option(
            option,
            n_ranks,
            space.n_microbatches,
            space.fitted,
            memory_limit,
            data_parallel,
            tied,
        )
        candidate = replace(candidate, n_microbatches=space.count)
        assert schedule is not None and candidate == c
        n_stages = schedule.n_stages
        return Contender(c, schedule, space.sizes_for(n_stages), space.costs_for(n_stages))

    ranking = rank(
        [
            replace(c, n_microbatches=space.count)
            for space in spaces
            for c in search(
                space.choices,
                n_ranks,
                space.n_microbatches,
                space.fitted,
                memory_limit,
                data_parallel,
                tied,
            )
        ],
        memory_limit,
    )
    try:
        best = choose(ranking, memory_limit)
    except NothingFitsError as exc:
        raise PipelineConfigError(str(exc)) from None
    shortlist = _shortlist(best, ranking, built, contenders, memory_limit)
    chosen = shortlist[0]
    return AutoPlan(
        best,
        tuple(ranking),
        chosen.schedule,
        chosen.partition,
        chosen.costs,
        memory_limit,
        tuple(shortlist) if len(shortlist) > 1 else (),
    )


def _shortlist(
    best: Candidate,
    ranking: Sequence[Candidate],
    built: Callable[[Candidate], Contender],
    count: int,
    memory_limit: float | None,
) -> list[Contender]:
    """The choice, then the fastest fitting candidate of each other kind (:func:`_kind`)
    within :data:`CONTENDER_WINDOW` of it, each running something new; ``count`` at most."""
    shortlist = [built(best)]
    kinds = {_kind(best)}
    for c in ranking:
        if len(shortlist) >= count or not fits(c, memory_limit):
            break
        if _kind(c) in kinds or c.makespan > best.makespan * (1 + CONTENDER_WINDOW):
            continue
        kinds.add(_kind(c))
        contender = built(c)
        if all(_differ(contender, other) for other in shortlist):
            shortlist.append(contender)
    return shortlist


def _kind(c: Candidate) -> tuple[str, int | None, bool, int | None]:
    """What makes schedules worth trying apart: the schedule, its stages per rank,
    2BP or not (the policies and W caps of one schedule differ less), and the
    micro-batch count where it is chosen."""
    return c.schedule, c.stages_per_rank, c.policy == NO_TWO_BP, c.n_microbatches


def _differ(a: Contender, b: Contender) -> bool:
    """True unless two contenders run the same actions on the same partition."""
    same = replace(a.schedule, name="") == replace(b.schedule, name="")
    return not (same and a.partition == b.partition)


def _same(option: Option, c: Candidate) -> bool:
    return replace(Option.of(c), split=option.split) == option
