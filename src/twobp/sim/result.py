"""The result of a simulation: the timeline and the figures read from it.

Both simulators (:func:`twobp.sim.simulate.simulate` and
:func:`twobp.sim.contention.simulate_shared`) are :func:`simulated`: a walk of
the schedule on the cost model's clock, summarised by :func:`summarise`, so
the figures mean the same thing whichever ran. This module imports no torch.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from twobp.schedule._timing import Timing, make_timing
from twobp.schedule.action import Action, Kind
from twobp.schedule.gradient_scatter import (
    SCATTERING,
    scattered_each_w_by_rank,
    scatters_at_reduce,
)
from twobp.schedule.kinds import Role
from twobp.schedule.schedule import Schedule
from twobp.schedule.two_bp import placed_at_run_time
from twobp.schedule.walk import walk
from twobp.sim.costs import CostModel
from twobp.sim.memory import peak_memory
from twobp.sim.reduction import reduction_ends
from twobp.timeline import Span, makespan


@dataclass(frozen=True)
class SimResult:
    """The simulated timeline of a schedule and its figures.

    Args:
        name: the schedule's name.
        spans: every compute action with its start and end time.
        makespan: time from the first start to the last end.
        busy: compute time per rank (indexed by rank).
        idle: ``makespan - busy`` per rank.
        bubble_ratios: ``idle / makespan`` per rank.
        bubble_ratio: mean of ``bubble_ratios``.
        peak_memory: the most memory each rank holds (cost model units).
        gather_wait: how much later the step ends because a stage's first
            ``F`` waits for the all-gather of its updated parameters (a
            sharded optimizer, see :func:`gather_wait`); in ``makespan``.
    """

    name: str
    spans: tuple[Span, ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_ratios: tuple[float, ...]
    bubble_ratio: float
    peak_memory: tuple[float, ...]
    gather_wait: float = 0.0

    @property
    def n_ranks(self) -> int:
        """Number of ranks."""
        return len(self.busy)


def summarise(schedule: Schedule, costs: CostModel, spans: Sequence[Span]) -> SimResult:
    """The figures of a simulated timeline.

    Args:
        schedule: the simulated schedule.
        costs: its cost model (for memory sizes).
        spans: every compute action of ``schedule`` as it ran.

    Returns:
        The result, with the spans sorted by rank and start time.
    """
    ranks = sorted(schedule.actions)
    waited = gather_wait(schedule, costs, spans)
    span = makespan(spans)
    total = span + waited
    # One pass over the spans (busy_time per rank would read them all once per rank).
    per_rank = dict.fromkeys(ranks, 0.0)
    for s in spans:
        if s.action.kind.role is Role.COMPUTE:
            per_rank[s.rank] = per_rank.get(s.rank, 0.0) + s.duration
    busy = tuple(per_rank[r] for r in ranks)
    # As bubble_ratio(spans, r): the rank's idle fraction of the spans' makespan.
    ratios = tuple((span - b) / span if span > 0 else 0.0 for b in busy)
    return SimResult(
        name=schedule.name,
        spans=tuple(sorted(spans, key=lambda s: (s.rank, s.start))),
        makespan=total,
        busy=busy,
        idle=tuple(total - b for b in busy),
        bubble_ratios=ratios,
        bubble_ratio=sum(ratios) / len(ratios),
        peak_memory=peak_memory(spans, costs, schedule.placement, scattering(schedule, costs)),
        gather_wait=waited,
    )


def gather_wait(schedule: Schedule, costs: CostModel, spans: Sequence[Span]) -> float:
    """The time a sharded optimizer's gathers add to a step (``costs.gather``).

    After ``optimizer.step()`` each rank all-gathers the updated parameters
    of its stages, one after another on its link in the order of their first
    ``F``, from the start of the step. Each first ``F`` runs through its stage
    in ``costs.gather_pieces`` equal parts, part ``k`` once the ``k``-th part
    of its stage's gather has arrived (the runtime's block-by-block wait); it
    ends later than the timeline says by what it waited. The step is taken to
    end later by the longest such wait: exact for the stage that starts the
    step (every action after it moves with it), an estimate where a later
    stage waits within its slack.
    """
    assert costs.gather is not None
    if not any(costs.gather):
        return 0.0
    first: dict[int, Span] = {}
    for span in spans:
        a = span.action
        if a.kind is Kind.FORWARD and (a.stage not in first or span.start < first[a.stage].start):
            first[a.stage] = span
    origin = min((s.start for s in spans), default=0.0)
    pieces = costs.gather_pieces
    longest = 0.0
    for rank in range(schedule.n_ranks):
        mine = [s for s, r in enumerate(schedule.placement) if r == rank and s in first]
        stages = sorted((first[s].start, s) for s in mine)
        ready = origin
        for start, stage in stages:
            gather, run = costs.gather[stage], first[stage].end - start
            end = start
            for k in range(pieces):
                end = max(end, ready + (k + 1) * gather / pieces) + run / pieces
            ready += gather
            longest = max(longest, end - (start + run))
    return longest


def simulated(
    schedule: Schedule, costs: CostModel, slowdown: Callable[[int], float] | None = None
) -> SimResult:
    """Walk ``schedule`` with the times and transfer delays of ``costs``, and summarise.

    Transfer actions take no time and are skipped: transfers are modelled by
    their delay, and by the sender's ``costs.send_overhead``, which lengthens
    the action whose result crosses to another rank (the transfer leaves at
    its end), as the 2BP weight placement times them
    (:func:`twobp.schedule._timing.make_timing`).

    Args:
        schedule: the ordered actions of every rank.
        costs: a cost model with one entry per stage of the schedule.
        slowdown: how many times slower each action runs while ``k`` ranks
            compute at once; ``None`` for fixed times.

    Returns:
        The timeline and its figures.

    Raises:
        ValueError: if the cost model has another number of stages, or a rank
            lists the same work twice.
        DeadlockError: if the schedule cannot finish.
    """
    if costs.n_stages != schedule.n_stages:
        raise ValueError(
            f"the cost model has {costs.n_stages} stages but schedule "
            f"{schedule.name or ''!r} has {schedule.n_stages}; fit it with "
            f"costs.for_schedule({schedule.n_stages}, {schedule.n_pipelines})"
        )
    timing = make_timing(costs, schedule)
    if costs.jitter:
        timing = jittered(timing, costs.jitter, costs.jitter_seed)
    schedule = placed_at_run_time(schedule, timing)
    walked = walk(schedule, timing.duration, transfer=timing.transfer, slowdown=slowdown)
    spans = [Span(r, x.action, x.start, x.end) for r, runs in walked.runs.items() for x in runs]
    return summarise(schedule, costs, reductions_met(schedule, costs, spans))


def jittered(timing: Timing, spread: float, seed: int) -> Timing:
    """``timing`` with each action's time drawn around it: normal, of relative spread
    ``spread``, at least a tenth of it; one draw per stage, kind, micro-batch and
    ``seed`` (the same work gets the same time in any schedule and any process). An
    action over several micro-batches (a concatenated ``W``) takes the mean of their
    draws, so a ``W`` run over micro-batches together or one by one draws alike."""

    def factor(action: Action, microbatch: int) -> float:
        key = zlib.crc32(f"{seed}:{action.stage}:{action.kind.value}:{microbatch}".encode())
        return max(0.1, 1.0 + spread * random.Random(key).gauss(0.0, 1.0))

    def duration(action: Action) -> float:
        mbs = action.microbatches
        return timing.duration(action) * sum(factor(action, mb) for mb in mbs) / len(mbs)

    return Timing(duration, timing.transfer)


def scattering(schedule: Schedule, costs: CostModel) -> dict[int, frozenset[int]] | None:
    """Each rank's stages that reduce-scatter their gradients after each ``W`` (sharded
    parameters), agreed among each stage's holders as the runtime does
    (:func:`~twobp.schedule.gradient_scatter.scattered_each_w_by_rank`); None otherwise."""
    if not costs.shard_parameters or costs.scatter_each_w is False:
        return None
    return scattered_each_w_by_rank(schedule, costs.scatter_each_w)


def reductions_met(schedule: Schedule, costs: CostModel, spans: Sequence[Span]) -> list[Span]:
    """The spans with each gradient reduction ending when its all-reduce can.

    See :func:`twobp.sim.reduction.reduction_ends`. A span of ``R`` lasts
    from its issue to the end of its all-reduce. With sharded parameters whose gradients
    are reduce-scattered after each ``W`` (``costs.scatter_each_w``), each such ``W`` (or
    ``B``) is followed by a span of ``R`` over its micro-batches, from its end to the end
    of its reduce-scatter, sharing the rank's link with the others; the stage's listed
    ``R`` then sends nothing (:mod:`twobp.schedule.gradient_scatter`).
    """
    spans = list(spans)
    scatters: list[int] = []
    idle: dict[int, float] = {}
    agreed = scattering(schedule, costs)
    if agreed is not None:
        for rank, actions in schedule.actions.items():
            each = agreed[rank]
            if not each:
                continue
            reducing = scatters_at_reduce(actions, each)
            for i, s in enumerate(list(spans)):
                a = s.action
                if s.rank != rank or a.stage not in each:
                    continue
                if a.kind in SCATTERING:
                    scatters.append(len(spans))
                    reduce = Action.make(a.stage, Kind.REDUCE, a.microbatches)
                    spans.append(Span(rank, reduce, s.end, s.end))
                elif a.kind is Kind.REDUCE and a.stage not in reducing:
                    idle[i] = 0.0
    ends = reduction_ends(schedule, costs, spans, idle, scatters)
    return [
        Span(s.rank, s.action, s.start, ends[i]) if i in ends else s for i, s in enumerate(spans)
    ]
