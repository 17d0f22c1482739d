"""``recompute="auto"``: rebuild only the stashes that do not fit (no torch).

A split stage keeps each micro-batch's stash from its ``I`` until its
``W``; under ``paper`` most ``W`` run at the end, so every stash of the step
is held at once there. :func:`fewest_rebuilds` keeps the stashes that fit a
memory limit and rebuilds the rest: while some rank's simulated peak is over
the limit, it takes one stash held at that peak and marks its micro-batch
to be rebuilt (:func:`twobp.schedule.rebuild.mark_rebuilds`: its ``I``
becomes an ``IR`` that keeps only the inputs and output gradients, its ``W``
a ``WR`` that runs ``F`` and ``I`` again first), simulating the
:data:`TRIED` longest held stashes it could take, each with its ``WR`` where
its ``W`` was and at the end of its rank's step, and taking the one that
lowers the excess most, then the one
whose rebuild costs the step least under the cost model (a rebuild where its
rank would wait anyway costs nothing), then the one held longest. It stops
at the first schedule that fits: no fewer rebuilds fit by this order, and a
schedule that fits without any is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

from twobp.schedule.action import Kind
from twobp.schedule.rebuild import mark_rebuilds, rebuilt_microbatches
from twobp.schedule.schedule import Schedule
from twobp.sim.cost_io import format_amount
from twobp.sim.costs import CostModel
from twobp.sim.memory import memory_timeline
from twobp.sim.result import SimResult, scattering
from twobp.sim.simulate import simulate

__all__ = ["RebuildError", "fewest_rebuilds", "rebuild_count"]

_EPS = 1e-9

TRIED = 4
"""The stashes held at a peak that are simulated rebuilt, the longest held first."""

Pick = tuple[int, int, bool]
"""A stash to rebuild: its stage, its micro-batch, and whether its ``WR`` runs last."""


class RebuildError(ValueError):
    """No choice of rebuilt stashes fits the memory limit (the message says what is left)."""


def rebuild_count(schedule: Schedule) -> int:
    """How many stashes the schedule rebuilds (its ``IR`` actions)."""
    return sum(len(mbs) for mbs in rebuilt_microbatches(schedule).values())


def fewest_rebuilds(schedule: Schedule, costs: CostModel, memory_limit: float) -> Schedule:
    """The schedule with the fewest stashes rebuilt that keeps every rank within ``memory_limit``.

    Args:
        schedule: a finished compute schedule (its ``I`` and ``W`` placed).
        costs: its cost model (fitted to its stages), with memory sizes.
        memory_limit: memory per rank, in the cost model's unit.

    Returns:
        The schedule itself if it fits, else the same schedule with the
        chosen micro-batches' ``I`` and ``W`` turned into ``IR`` and ``WR``.

    Raises:
        RebuildError: if the limit is still exceeded where no stash is held
            (activations, parameters, a rebuild itself), or rebuilding a
            stash saves nothing; the message names the rank and what it needs.
    """
    current = schedule
    result = simulate(current, costs)
    chosen: dict[int, set[int]] = {s: set(m) for s, m in rebuilt_microbatches(schedule).items()}
    last: set[tuple[int, int]] = set()
    while _excess(result, memory_limit) > _EPS:
        rank = max(range(len(result.peak_memory)), key=lambda r: result.peak_memory[r])
        held = _held_at_peak(result, costs, current, rank)
        if not held:
            raise RebuildError(
                f"rank {rank} needs {format_amount(result.peak_memory[rank])} with "
                f"{_count(chosen)} stashes rebuilt, over memory_limit="
                f"{format_amount(memory_limit)}, where it holds no stash whose rebuild would "
                "keep less (activations, parameters, a stash being rebuilt); raise the limit, "
                "or recompute activations too"
            )
        best: tuple[tuple[float, float, float, int], Schedule, SimResult, Pick] | None = None
        # The longest held first: with most stages and micro-batches only they are tried.
        tried = sorted(held.items(), key=lambda item: (-item[1], item[0]))[:TRIED]
        for (stage, mb), lifetime in tried:
            more = {**chosen, stage: {*chosen.get(stage, ()), mb}}
            for deferred in (False, True):
                pick = (stage, mb, deferred)
                trial = mark_rebuilds(schedule, more, {*last, (stage, mb)} if deferred else last)
                outcome = simulate(trial, costs)
                key = (_excess(outcome, memory_limit), outcome.makespan, -lifetime, deferred)
                if best is None or key < best[0]:
                    best = (key, trial, outcome, pick)
        assert best is not None
        _, current, result, (stage, mb, deferred) = best
        chosen.setdefault(stage, set()).add(mb)
        if deferred:
            last.add((stage, mb))
    return current


def _excess(result: SimResult, memory_limit: float) -> float:
    return sum(max(0.0, p - memory_limit) for p in result.peak_memory)


def _count(chosen: Mapping[int, set[int]]) -> int:
    return sum(len(m) for m in chosen.values())


def _held_at_peak(
    result: SimResult, costs: CostModel, schedule: Schedule, rank: int
) -> dict[tuple[int, int], float]:
    """The stashes ``rank`` holds at its peak that a rebuild could drop: per
    ``(stage, micro-batch)``, how long it is held (from its ``I`` to its ``W``)."""
    agreed = scattering(schedule, costs)
    points = memory_timeline(result.spans, costs, schedule.placement, agreed)[rank]
    top = max(b for _, b in points)
    # The peak is held from the first change that reaches it until the next change.
    start = next(t for t, b in points if b >= top - _EPS)
    kept: dict[tuple[int, int], float] = {}
    done: dict[tuple[int, int], float] = {}
    for span in result.spans:
        a = span.action
        if span.rank != rank:
            continue
        if a.kind is Kind.BACKWARD_INPUT:
            kept[(a.stage, a.microbatch)] = span.end
        elif a.kind is Kind.BACKWARD_WEIGHT:
            for m in a.microbatches:
                done[(a.stage, m)] = span.end
    saves = costs.weight_grad_bytes
    assert saves is not None
    return {
        key: done[key] - made
        for key, made in kept.items()
        if key in done
        and made <= start + _EPS < done[key]
        and saves[key[0]] > costs.checkpoint_bytes[key[0]]
    }
