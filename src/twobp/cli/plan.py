"""``twobp plan``: rank every schedule and 2BP policy by simulated step time.

Example::

    twobp plan --stages 4 --microbatches 8 --costs F=1,I=1,W=1 --memory-limit 6

simulates each schedule with each 2BP policy (``off``, ``eager``, ``paper``,
``fill``) on the same cost model, lists them from the shortest step to the
longest with their bubble ratio and peak memory, marks those over the
per-rank memory limit, and names the one it recommends. With a memory limit,
the ``fill`` policy is told how many micro-batches each rank may hold between
their ``F`` and their ``W`` (see :func:`twobp.sim.memory.microbatch_limit`), so that it runs a
stored ``W`` early rather than go over the limit.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twobp.cli.errors import UsageError, check_at_least
from twobp.cli.simulate import COSTS_HELP, NO_TWO_BP, build_schedule, cost_model, format_amount
from twobp.config import add_arguments, doc, from_namespace
from twobp.schedule import SCHEDULES, TWO_BP_POLICIES, apply_two_bp
from twobp.sim.cost_io import parse_amount
from twobp.sim.costs import CostModel
from twobp.sim.memory import least_fill_memory, microbatch_limit
from twobp.sim.simulate import DeadlockError, simulate

ALL_POLICIES = (NO_TWO_BP, *TWO_BP_POLICIES)


@dataclass
class PlanConfig:
    """Options of ``twobp plan``."""

    stages: int = doc("number of pipeline ranks p (one process each)", 4)
    microbatches: int = doc("micro-batches per training step m", 8)
    stages_per_rank: int | None = doc(
        "stages per rank V for the schedules that hold several (interleaved-1f1b); "
        "others keep their own",
        None,
    )
    costs: str = doc(COSTS_HELP, "F=1,I=1,W=1")
    costs_file: str | None = doc(
        "a cost profile JSON (format: twobp.sim.costs); replaces --costs", None
    )
    memory_limit: str | None = doc(
        "memory limit per rank, in the cost model's unit (bytes for a profile; 16GiB, 80GB "
        "accepted; micro-batch activations for the default --costs); default: none",
        None,
    )
    # doc() gives list defaults a default_factory, so no list is shared.
    schedules: list[str] = doc("schedules to compare", [*SCHEDULES], choices=tuple(SCHEDULES))  # noqa: RUF009
    policies: list[str] = doc(  # noqa: RUF009
        "2BP policies to compare (off: as generated)", [*ALL_POLICIES], choices=ALL_POLICIES
    )
    markdown: bool = doc("print the table as markdown", False)


@dataclass(frozen=True)
class Candidate:
    """One schedule with one 2BP policy, simulated (or why it could not be).

    Args:
        schedule: the schedule name.
        policy: the 2BP policy (``off`` for none).
        makespan: simulated step time (``inf`` if it could not run).
        bubble_ratio: mean idle fraction of the ranks.
        peak_memory: the largest peak over the ranks.
        error: why the combination could not be simulated, or ``""``.
    """

    schedule: str
    policy: str
    makespan: float = math.inf
    bubble_ratio: float = math.nan
    peak_memory: float = math.nan
    error: str = ""

    @property
    def ok(self) -> bool:
        """True if it was simulated."""
        return not self.error


def _stages_per_rank(name: str, wanted: int | None) -> int | None:
    info = SCHEDULES[name]
    allowed = info.allowed_stages_per_rank
    if wanted is None or info.default_stages_per_rank == 1:
        return None
    return wanted if allowed is None or wanted in allowed else None


def evaluate(
    costs: CostModel,
    n_ranks: int,
    n_microbatches: int,
    schedules: Sequence[str],
    policies: Sequence[str],
    stages_per_rank: int | None = None,
    memory_limit: float | None = None,
) -> list[Candidate]:
    """Simulate every schedule with every policy, fastest first.

    Args:
        costs: the cost model of one rank's share per stage (split for
            schedules with several stages per rank) or of every stage.
        n_ranks: number of ranks ``p``.
        n_microbatches: micro-batches per step ``m``.
        schedules: names from :data:`twobp.schedule.SCHEDULES`.
        policies: ``off`` and/or names from :data:`twobp.schedule.TWO_BP_POLICIES`.
        stages_per_rank: ``V`` for the schedules that hold several stages.
        memory_limit: memory per rank (cost-model unit); ``fill`` then keeps
            each rank to the micro-batches of :func:`twobp.sim.memory.microbatch_limit`, or
            reports why it cannot.

    Returns:
        The candidates ordered by makespan, then peak memory; those that could
        not be built (e.g. ``m`` not a multiple of ``p`` for interleaved 1F1B)
        come last with their ``error``.

    Raises:
        ValueError: on an unknown schedule or policy name.
    """
    unknown = [s for s in schedules if s not in SCHEDULES]
    unknown += [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise ValueError(
            f"unknown schedule or policy {', '.join(map(repr, unknown))}; schedules: "
            f"{', '.join(SCHEDULES)}; policies: {', '.join(ALL_POLICIES)}"
        )
    out = []
    for name in schedules:
        for policy in policies:
            try:
                bounded = policy == "fill" and memory_limit is not None
                schedule, fitted = build_schedule(
                    name,
                    n_ranks,
                    n_microbatches,
                    _stages_per_rank(name, stages_per_rank),
                    NO_TWO_BP if bounded else policy,
                    costs,
                )
                if bounded:
                    assert memory_limit is not None
                    held = microbatch_limit(schedule, fitted, memory_limit)
                    if held < 1:
                        raise ValueError(
                            f"not one micro-batch fits in {format_amount(memory_limit)} per rank"
                        )
                    need = least_fill_memory(schedule, fitted)
                    if memory_limit < need:
                        raise ValueError(
                            f"needs at least {format_amount(need)} per rank, whatever the W "
                            f"placement (its order of F and I alone); the limit is "
                            f"{format_amount(memory_limit)}"
                        )
                    schedule = apply_two_bp(schedule, policy, costs=fitted, memory_limit=held)
                result = simulate(schedule, fitted)
            except (ValueError, DeadlockError) as exc:
                out.append(Candidate(name, policy, error=str(exc).splitlines()[0]))
                continue
            out.append(
                Candidate(
                    name,
                    policy,
                    result.makespan,
                    result.bubble_ratio,
                    max(result.peak_memory),
                )
            )
    return sorted(out, key=lambda c: (not c.ok, c.makespan, c.peak_memory))


def recommend(candidates: Sequence[Candidate], memory_limit: float | None) -> str:
    """One sentence naming the candidate to use and why.

    The fastest candidate whose peak memory fits ``memory_limit``; if none
    fits, the one that needs the least memory.
    """
    ran = [c for c in candidates if c.ok]
    if not ran:
        return "Nothing could be simulated; see the errors above."
    fits = [c for c in ran if memory_limit is None or c.peak_memory <= memory_limit]
    if not fits:
        least = min(ran, key=lambda c: (c.peak_memory, c.makespan))
        return (
            f"Nothing fits in {format_amount(memory_limit or 0)} per rank: {_label(least)} needs "
            f"the least ({format_amount(least.peak_memory)}); use fewer micro-batches in flight, "
            "more ranks or a higher limit."
        )
    best = fits[0]
    baseline = next((c for c in ran if c.schedule == best.schedule and c.policy == NO_TWO_BP), None)
    gain = (
        f", {baseline.makespan / best.makespan:.2f}x the throughput of {best.schedule} without 2BP"
        if baseline is not None and best.policy != NO_TWO_BP and best.makespan > 0
        else ""
    )
    limit = (
        f"fits the limit of {format_amount(memory_limit)}"
        if memory_limit is not None
        else "(no memory limit given)"
    )
    return (
        f"Recommended: {_label(best)}: the shortest simulated step ({best.makespan:.4g}{gain}) "
        f"whose peak memory per rank ({format_amount(best.peak_memory)}) {limit}."
    )


def _label(c: Candidate) -> str:
    return c.schedule if c.policy == NO_TWO_BP else f"{c.schedule} with 2BP ({c.policy})"


def format_table(
    candidates: Sequence[Candidate], memory_limit: float | None, markdown: bool = False
) -> str:
    """The ranking as an aligned text table, or as markdown."""
    ran = [c for c in candidates if c.ok]
    best = min((c.makespan for c in ran), default=math.nan)
    header = ["#", "schedule", "2BP", "makespan", "throughput", "bubble", "peak memory", ""]
    rows = []
    for i, c in enumerate(candidates, 1):
        if not c.ok:
            rows.append([str(i), c.schedule, c.policy, "-", "-", "-", "-", f"n/a: {c.error}"])
            continue
        over = memory_limit is not None and c.peak_memory > memory_limit
        rows.append(
            [
                str(i),
                c.schedule,
                c.policy,
                f"{c.makespan:.4g}",
                f"{best / c.makespan:.2f}x" if c.makespan > 0 else "-",
                f"{c.bubble_ratio:.1%}",
                format_amount(c.peak_memory),
                "over memory limit" if over else "",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join([*header[:-1], "note"]) + " |"]
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {0, 3, 4, 5, 6}

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


def run(config: PlanConfig) -> int:
    """Rank, print and recommend; returns the exit code.

    Raises:
        UsageError: on a count below 1 or a memory limit that is not a positive amount.
        ValueError: on options that do not fit together.
    """
    check_at_least(
        stages=(config.stages, 1),
        microbatches=(config.microbatches, 1),
        stages_per_rank=(config.stages_per_rank, 1),
    )
    try:
        limit = parse_amount(config.memory_limit) if config.memory_limit else None
    except ValueError as exc:
        raise UsageError(f"--memory-limit {config.memory_limit}: {exc}") from exc
    if limit is not None and not limit > 0:
        raise UsageError(f"--memory-limit must be > 0, got {config.memory_limit}")
    costs = cost_model(config.costs, config.costs_file, config.stages)
    candidates = evaluate(
        costs,
        config.stages,
        config.microbatches,
        config.schedules,
        config.policies,
        config.stages_per_rank,
        limit,
    )
    limit_text = (
        "no memory limit" if limit is None else f"memory limit {format_amount(limit)} per rank"
    )
    print(
        f"{config.stages} ranks, {config.microbatches} micro-batches, {limit_text}; "
        "throughput relative to the fastest"
    )
    print(format_table(candidates, limit, markdown=config.markdown))
    print()
    print(recommend(candidates, limit))
    return 0


def _main(args: argparse.Namespace) -> int:
    try:
        return run(from_namespace(PlanConfig, args))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def register(subparsers: Any) -> None:
    """Add ``plan`` to the ``twobp`` command."""
    parser = subparsers.add_parser(
        "plan",
        help="rank schedules and 2BP policies by simulated throughput and memory",
        description=(
            "Rank every schedule and 2BP policy by simulated step time, mark those over "
            "the memory limit and recommend one."
        ),
    )
    add_arguments(parser, PlanConfig)
    parser.set_defaults(func=_main)
