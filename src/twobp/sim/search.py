"""The one search: every schedule, 2BP policy and stage, W cap, recompute mode, by its step.

An :class:`Option` is one point of the option space every choice of twobp
searches: schedule, stages per rank, 2BP policy, the stages it splits, the
cap on the micro-batches one ``W`` covers, the recompute mode and the
engine's concatenation cap. :func:`options` lists the combinations that exist
for ``p`` ranks (every named schedule with each number of stages per rank it
takes, up to :data:`MAX_STAGES_PER_RANK`, without 2BP (``off``) and with each
policy, and for ``paper`` and ``fill`` each cap of
:data:`MICROBATCHES_PER_W_TRIED` and no cap); :func:`splits` the sets of split
stages. :func:`search` simulates options under a cost model per stage count
(with its contention), bounds ``fill`` by a memory limit and orders the
results (:func:`rank`); :func:`choose` takes the fastest that fits, or says
how much memory the least hungry one needs.

Its views: ``schedule="auto"`` and ``twobp plan`` (:mod:`twobp.sim.planner`)
search schedules and policies; ``two_bp=None`` searches the split stages of
its schedule (:mod:`twobp.sim.split_choice`); ``recompute="auto"`` the
recompute dimension of its schedule (:mod:`twobp.sim.rebuild_choice`).
This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product

from twobp.schedule import SCHEDULES, Schedule
from twobp.sim.candidate import (
    NO_TWO_BP,
    SEARCHED_POLICIES,
    Candidate,
    describe,
    simulate_candidate,
    simulate_prepared,
    uncontended,
)
from twobp.sim.cost_io import format_amount
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor
from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_AUTO, with_recompute

__all__ = [
    "GROUPED_POLICIES",
    "MAX_STAGES_PER_RANK",
    "MICROBATCHES_PER_W_TRIED",
    "NEAR_TIE",
    "Candidate",
    "NothingFitsError",
    "Option",
    "auto_options",
    "choose",
    "describe",
    "fits",
    "microbatch_counts",
    "options",
    "rank",
    "search",
    "simulate_option",
    "simulate_prepared",
    "splits",
    "uncontended",
]

MAX_STAGES_PER_RANK = 2
"""Stages per rank tried for the schedules that take any number (more cost more messages)."""
MICROBATCHES_PER_W_TRIED = (1, 2, 4)
"""Caps on the micro-batches one ``W`` covers that are tried besides no cap."""
NEAR_TIE = 0.02
"""Candidates within this fraction of the fastest are a tie, broken without contention."""
GROUPED_POLICIES = ("paper", "fill")
"""The policies whose ``W`` actions :func:`apply_two_bp` caps by ``microbatches_per_w``."""
REBUILT_OPTIONS = 8
"""With ``recompute="auto"``, how many options over the memory limit (the fastest
first, among those faster than the fastest that fits) have their stashes rebuilt."""
MICROBATCH_MULTIPLES = (1, 2, 4, 8)
"""The micro-batch counts ``n_microbatches="auto"`` tries, in multiples of the ranks."""


@dataclass(frozen=True)
class Option:
    """One combination to simulate: a point of the one option space of both planners.

    Two caps read alike and are not the same: ``microbatches_per_w`` is how
    many micro-batches one ``W`` *action* of the schedule may cover (the 2BP
    placement's cap, a schedule option); ``weight_group_size`` is how many
    micro-batches the 2BP *engine* concatenates (and, recomputing
    derivatives, rebuilds) at once inside one ``W`` (the ``Pipeline``
    argument of that name, a cost-model option).

    Args:
        schedule: a name of :data:`twobp.schedule.SCHEDULES`.
        policy: ``off`` or a 2BP policy.
        stages_per_rank: stages per rank ``V`` (None: the schedule's default).
        microbatches_per_w: the most micro-batches one ``W`` action covers (None: no cap).
        recompute: ``off``, a recompute mode of every stage
            (:data:`twobp.sim.recompute.RECOMPUTE_MODES`), or ``auto``: the
            stashes over the memory limit rebuilt, chosen per stage and
            micro-batch (:func:`twobp.sim.rebuild.fewest_rebuilds`).
        weight_group_size: the engine's concatenation cap (None: no cap).
        split: per stage of the model, True where its backward is split
            (``two_bp`` as a list, with a policy); None: every stage alike.
    """

    schedule: str
    policy: str
    stages_per_rank: int | None
    microbatches_per_w: int | None = None
    recompute: str = NO_RECOMPUTE
    weight_group_size: int | None = None
    split: tuple[bool, ...] | None = None

    @classmethod
    def of(cls, candidate: Candidate) -> Option:
        """The option ``candidate`` was simulated as."""
        c = candidate
        return cls(
            c.schedule,
            c.policy,
            c.stages_per_rank,
            c.microbatches_per_w,
            c.recompute,
            c.weight_group_size,
            c.split,
        )


class NothingFitsError(ValueError):
    """No combination fits the memory limit (the message says what the least needs)."""


def options(
    n_microbatches: int,
    *,
    schedules: Sequence[str] | None = None,
    policies: Sequence[str] = SEARCHED_POLICIES,
    max_stages_per_rank: int = MAX_STAGES_PER_RANK,
    recomputes: Sequence[str] = (NO_RECOMPUTE,),
    weight_group_sizes: Sequence[int | None] = (None,),
) -> list[Option]:
    """Every combination of schedule, stage count, policy, ``W`` cap and recompute mode.

    Args:
        n_microbatches: micro-batches per step (``W`` caps below it only).
        schedules: names to try (None: all of :data:`twobp.schedule.SCHEDULES`).
        policies: ``off`` and/or 2BP policies.
        max_stages_per_rank: the most stages per rank tried for schedules
            that take any number.
        recomputes: recompute modes of every stage to try (``off``: none).
        weight_group_sizes: the engine's concatenation caps to try (None: no cap).

    Returns:
        The options, in a fixed order.
    """
    out = []
    for recompute in recomputes:
        for concat in weight_group_sizes:
            for name in SCHEDULES if schedules is None else schedules:
                info = SCHEDULES[name]
                allowed = info.allowed_stages_per_rank
                counts = range(1, max_stages_per_rank + 1) if allowed is None else allowed
                caps = [None, *(g for g in MICROBATCHES_PER_W_TRIED if g < n_microbatches)]
                for v in counts:
                    for policy in policies:
                        for cap in caps if policy in GROUPED_POLICIES else [None]:
                            out.append(Option(name, policy, v, cap, recompute, concat))
    return out


def splits(n_stages: int) -> Iterator[tuple[bool, ...]]:
    """Every set of split stages of a model of ``n_stages`` stages (``2**n_stages``),
    fewest split first within each count of stages."""
    return iter(sorted(product((False, True), repeat=n_stages), key=sum))


def microbatch_counts(batch_size: int, n_ranks: int) -> list[int]:
    """The micro-batch counts ``n_microbatches="auto"`` tries for a batch.

    Every count cuts the batch into equal micro-batches, so each gives the
    same gradient: ``p``, ``2p``, ``4p`` and ``8p`` micro-batches
    (:data:`MICROBATCH_MULTIPLES`) where the batch divides by them; if it
    divides by none, the divisors of the batch from ``p`` up (at most four,
    the smallest), or, for a batch smaller than ``p``, its own size.

    Args:
        batch_size: the samples of the batch (of one copy of the pipeline).
        n_ranks: ranks of the pipeline ``p``.

    Returns:
        The counts, smallest first (never empty for a batch of at least one sample).

    Raises:
        ValueError: if the batch is empty.
    """
    if batch_size < 1:
        raise ValueError(f"a batch of {batch_size} samples cannot be cut into micro-batches")
    multiples = [k * n_ranks for k in MICROBATCH_MULTIPLES if batch_size % (k * n_ranks) == 0]
    if multiples:
        return multiples
    divisors = [m for m in range(n_ranks, batch_size + 1) if batch_size % m == 0]
    return divisors[: len(MICROBATCH_MULTIPLES)] or [batch_size]


def auto_options(
    n_microbatches: int,
    *,
    two_bp: bool = True,
    schedules: Sequence[str] | None = None,
    policies: Sequence[str] | None = None,
    stages_per_rank: int | None = None,
    recompute: str = NO_RECOMPUTE,
) -> list[Option]:
    """The combinations ``schedule="auto"`` tries, the same for ``twobp plan``.

    One pipeline per schedule (the search cuts the model into the
    schedule's stages; Chimera's two pipelines are not tried), among
    ``schedules``; without ``two_bp`` only fused schedules, without 2BP.

    Args:
        n_microbatches: micro-batches per step.
        two_bp: False tries only schedules that are not natively split, as generated.
        schedules: the names to try (None: every one).
        policies: ``off`` and/or 2BP policies (None: every one, or ``off`` without 2BP).
        stages_per_rank: only this many stages per rank (None: any).
        recompute: ``off``, or ``auto`` (``recompute="auto"``: each option
            rebuilds the stashes that do not fit the memory limit).
    """
    names = [
        n
        for n, info in SCHEDULES.items()
        if (schedules is None or n in schedules)
        and (two_bp or not info.natively_split)
        and info.pipelines == 1
    ]
    tried = policies or (SEARCHED_POLICIES if two_bp else (NO_TWO_BP,))
    return [
        o
        for o in options(n_microbatches, schedules=names, policies=tried, recomputes=(recompute,))
        if stages_per_rank is None or o.stages_per_rank == stages_per_rank
    ]


def simulate_option(
    option: Option,
    n_ranks: int,
    n_microbatches: int,
    costs: CostModel | CostsFor,
    memory_limit: float | None = None,
    data_parallel: int = 1,
    tied: bool = False,
    *,
    source: Schedule | None = None,
    reduce: bool | None = None,
) -> tuple[Candidate, Schedule | None]:
    """Build and simulate one option (:func:`twobp.sim.candidate.simulate_candidate`).

    ``fill`` under a memory limit keeps each rank to the micro-batches of
    :func:`twobp.sim.memory.microbatch_limit`; the other policies are
    simulated as they are and may go over it (:func:`choose` skips them).
    The option's recompute mode and concatenation cap change the costs
    (:func:`twobp.sim.recompute.with_recompute`); ``recompute="auto"``
    changes the schedule instead: the stashes that do not fit
    ``memory_limit`` are rebuilt (its ``IR`` and ``WR``), the fewest that fit.

    Args:
        option: the combination.
        n_ranks: number of ranks ``p``.
        n_microbatches: micro-batches per step ``m``.
        costs: the cost model of the model's stages, or of the model cut into
            a given number of stages; a schedule of several pipelines gets it
            once per pipeline.
        memory_limit: memory per rank, or None.
        data_parallel: copies of the pipeline; with more than one, each
            stage's gradients are all-reduced over them (the ``R`` action).
        tied: some weight is used by several blocks (its stages reduce it).
        source: the sourced schedule the option prepares, instead of the one
            its name generates (a pipeline's own; ``costs`` may be fitted to it).
        reduce: whether its stages reduce their gradients (None: as
            ``data_parallel`` and ``tied`` say).

    Returns:
        The candidate (with ``error`` if it cannot be built or run) and its
        schedule (None on error): the prepared schedule a pipeline with
        these options runs, reductions and first-stage fusion included.
    """
    variant: CostModel | CostsFor = costs
    rebuilding = option.recompute == RECOMPUTE_AUTO
    if rebuilding and memory_limit is None:
        error = "recompute='auto' rebuilds what does not fit a memory limit; give memory_limit"
        return Candidate(option.schedule, option.policy, error=error), None
    changed = not rebuilding and option.recompute != NO_RECOMPUTE
    if changed or option.weight_group_size is not None:
        try:
            mode = NO_RECOMPUTE if rebuilding else option.recompute
            variant = _recomputed(costs, mode, option.weight_group_size)
        except ValueError as exc:
            return Candidate(option.schedule, option.policy, error=str(exc)), None
    candidate, schedule = simulate_candidate(
        option.schedule,
        option.policy,
        n_ranks,
        n_microbatches,
        variant,
        stages_per_rank=option.stages_per_rank,
        microbatches_per_w=option.microbatches_per_w,
        memory_limit=memory_limit,
        data_parallel=data_parallel,
        tied=tied,
        rebuild_within=memory_limit if rebuilding else None,
        split=option.split,
        source=source,
        reduce=reduce,
    )
    return (
        replace(candidate, recompute=option.recompute, weight_group_size=option.weight_group_size),
        schedule,
    )


def _recomputed(
    costs: CostModel | CostsFor, recompute: str, weight_group_size: int | None
) -> CostModel | CostsFor:
    if isinstance(costs, CostModel):
        return with_recompute(costs, recompute, weight_group_size)

    def costs_for(n_stages: int) -> CostModel:
        return with_recompute(costs(n_stages), recompute, weight_group_size)

    return costs_for


def rank(candidates: Sequence[Candidate], memory_limit: float | None) -> list[Candidate]:
    """The one ranking of both planners: those that fit first, fastest first.

    Returns:
        The candidates that fit ``memory_limit`` by makespan (then peak
        memory), then those over it, then those that could not be simulated
        (with their ``error``).
    """

    def order(c: Candidate) -> tuple[int, float, float]:
        group = 2 if not c.ok else 0 if fits(c, memory_limit) else 1
        return group, c.makespan, c.peak_memory

    return sorted(candidates, key=order)


def search(
    choices: Sequence[Option],
    n_ranks: int,
    n_microbatches: int,
    costs_for: CostModel | CostsFor,
    memory_limit: float | None = None,
    data_parallel: int = 1,
    tied: bool = False,
    *,
    source: Schedule | None = None,
    reduce: bool | None = None,
) -> list[Candidate]:
    """Simulate every option; those that fit first, fastest first.

    With ``data_parallel`` copies, every option reduces its stages' gradients
    over them, and with ``tied`` weights their stages reduce them; ``source``
    and ``reduce`` as for :func:`simulate_option`.

    Returns:
        The candidates in the order of :func:`rank`.
    """

    def run(option: Option) -> Candidate:
        return simulate_option(
            option,
            n_ranks,
            n_microbatches,
            costs_for,
            memory_limit,
            data_parallel,
            tied,
            source=source,
            reduce=reduce,
        )[0]

    rebuilding = [o for o in choices if o.recompute == RECOMPUTE_AUTO and memory_limit is not None]
    done = [run(o) for o in choices if o not in rebuilding]
    # A rebuild only adds work: an option that fits without one is its own answer, and
    # one whose step is no faster than the fastest that fits cannot win by rebuilding.
    kept = {o: run(replace(o, recompute=NO_RECOMPUTE)) for o in rebuilding}
    fitting = [c.makespan for c in kept.values() if fits(c, memory_limit)]
    bound = min([*fitting, *(c.makespan for c in done if fits(c, memory_limit))], default=math.inf)
    over = sorted(
        (o for o, c in kept.items() if c.ok and not fits(c, memory_limit) and c.makespan < bound),
        key=lambda o: kept[o].makespan,
    )[:REBUILT_OPTIONS]
    for option, candidate in kept.items():
        if option in over:
            done.append(run(option))
        elif fits(candidate, memory_limit) or not candidate.ok:
            done.append(replace(candidate, recompute=RECOMPUTE_AUTO))
        else:
            done.append(
                replace(
                    candidate,
                    recompute=RECOMPUTE_AUTO,
                    error="over the memory limit, and rebuilding cannot make it the fastest",
                )
            )
    return rank(done, memory_limit)


def fits(candidate: Candidate, memory_limit: float | None) -> bool:
    """True if the candidate ran and its peak memory per rank is within the limit."""
    return candidate.ok and (memory_limit is None or candidate.peak_memory <= memory_limit)


def choose(candidates: Sequence[Candidate], memory_limit: float | None) -> Candidate:
    """The fastest candidate within ``memory_limit``.

    Candidates within :data:`NEAR_TIE` of the fastest are a tie, which the
    step without contention breaks: contention measured on a shared machine
    is noisy, and the schedule that overlaps its ranks better loses nothing
    if they slow each other less than measured.

    Raises:
        NothingFitsError: if none ran, or none fits; the message names the
            one that needs the least memory and how much.
    """
    ran = [c for c in candidates if c.ok]
    if not ran:
        reasons = "; ".join(sorted({f"{c.schedule}: {c.error}" for c in candidates}))
        raise NothingFitsError(f"no schedule could be simulated ({reasons or 'none given'})")
    fitting = [c for c in ran if fits(c, memory_limit)]
    if not fitting:
        least = min(ran, key=lambda c: (c.peak_memory, c.makespan))
        raise NothingFitsError(
            f"no schedule fits memory_limit={format_amount(memory_limit or 0)} per rank: "
            f"{describe(least)} needs the least ({format_amount(least.peak_memory)}); raise "
            "the limit to at least that, or use fewer micro-batches or more ranks"
        )
    fastest = min(c.makespan for c in fitting)
    tied = [c for c in fitting if c.makespan <= fastest * (1 + NEAR_TIE)]

    def alone(c: Candidate) -> float:
        return c.makespan if math.isnan(c.uncontended_makespan) else c.uncontended_makespan

    return min(tied, key=lambda c: (alone(c), c.makespan, c.peak_memory))
