"""Memory over time, from a timeline and the memory sizes of a cost model.

What each action takes and gives back is read from the kind table
(:mod:`twobp.schedule.kinds`, its ``memory`` entries): a micro-batch's
activations on a stage are taken when its ``F`` starts and given back when
its ``I`` (or fused ``B``) ends; ``I`` leaves behind what the weight pass
needs, given back when the ``W`` that covers the micro-batch ends; a ``W``
that rebuilds its stash holds it while it runs; parameters are held
throughout. A kind declared in the table holds what its entry says. The
model reads only spans, so it applies to simulated and measured timelines
alike. With sharded parameters a stage's whole weights are held gathered from its
first ``F`` to its last ``I`` (``CostModel.gathered_bytes``). :func:`microbatch_limit`
turns a memory limit into the number of micro-batches a rank may hold, the unit
the 2BP ``fill`` policy bounds. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import accumulate

from twobp.schedule.action import Action, Kind
from twobp.schedule.gradient_scatter import MAKES_GRADIENTS, SCATTERING, scattered_each_w
from twobp.schedule.kinds import (
    ACTIVATIONS,
    MemoryChange,
    Moment,
    held_pools,
    kind_spec,
)
from twobp.schedule.schedule import Schedule
from twobp.sim.cost_io import format_amount
from twobp.sim.costs import CostModel, PerStage
from twobp.timeline import Span


def memory_timeline(
    spans: Sequence[Span],
    costs: CostModel,
    placement: Sequence[int],
    scattering: Mapping[int, frozenset[int]] | None = None,
) -> dict[int, list[tuple[float, float]]]:
    """Memory held by each rank after every change.

    Args:
        spans: the timeline (communication spans are ignored).
        costs: memory sizes per stage: ``parameter_bytes`` and
            ``optimizer_bytes`` (held throughout), and the pools
            the kind table's memory entries name (``activation_bytes``,
            ``weight_grad_bytes``, ``weight_rebuild_bytes``).
        placement: the rank of each stage (``placement[s]``).
        scattering: with sharded parameters, each rank's stages that reduce-scatter their
            gradients after each ``W``, as agreed among their holders
            (:func:`~twobp.schedule.gradient_scatter.scattered_each_w_by_rank`); None: each
            rank's own choice from its spans.

    Returns:
        For each rank, ``(time, bytes held)`` points in time order, starting
        with the parameters at the earliest start time; what one action
        takes and gives back at one moment is one change. When a free and an
        allocation happen at the same instant the free is counted first: a
        rank runs one action at a time, so the next one starts after the
        previous one has released its memory.

    Raises:
        ValueError: if a span names a stage the cost model does not have.
    """
    assert costs.parameter_bytes is not None
    optimizer = costs.optimizer_bytes or (0.0,) * costs.n_stages
    n_ranks = max(placement) + 1
    changes: dict[int, list[tuple[float, float]]] = {r: [] for r in range(n_ranks)}
    for span in spans:
        a = span.action
        if not a.kind.is_compute:
            continue
        if a.stage >= costs.n_stages:
            raise ValueError(
                f"{a} on rank {span.rank}: the cost model has only {costs.n_stages} stages"
            )
        # What an action does at one moment counts as one change.
        at = {Moment.START: 0.0, Moment.END: 0.0}
        for entry in kind_spec(a.kind).memory:
            at[entry.at] += entry.change * _entry_bytes(entry, a, costs)
        for moment, time in ((Moment.START, span.start), (Moment.END, span.end)):
            if at[moment]:
                changes[span.rank].append((time, at[moment]))
    for rank, time, delta in gathered_changes(spans, costs, scattering):
        changes[rank].append((time, delta))
    origin = min((s.start for s in spans), default=0.0)
    out: dict[int, list[tuple[float, float]]] = {}
    for rank in range(n_ranks):
        held = sum(
            b + o
            for s, (b, o) in enumerate(zip(costs.parameter_bytes, optimizer, strict=True))
            if placement[s] == rank
        )
        points = [(origin, held)]
        for time, delta in sorted(changes[rank]):
            held += delta
            points.append((time, held))
        out[rank] = points
    return out


def gathered_changes(
    spans: Sequence[Span],
    costs: CostModel,
    scattering: Mapping[int, frozenset[int]] | None = None,
) -> list[tuple[int, float, float]]:
    """``(rank, time, bytes)`` of each stage's gathered weights (``costs.gathered_bytes``):
    taken when its first ``F`` starts, given back when its last action that needs them
    ends (``I`` or ``B``; ``W`` too with ``costs.free_before_w`` False; recomputation's
    actions, which run ``F`` again, too)."""
    gathered = costs.gathered_bytes or ()
    first: dict[int, tuple[float, int]] = {}
    last: dict[int, float] = {}
    for span in spans:
        a = span.action
        if not a.kind.is_compute or a.stage >= len(gathered) or not gathered[a.stage]:
            continue
        if a.kind is Kind.FORWARD and (a.stage not in first or span.start < first[a.stage][0]):
            first[a.stage] = (span.start, span.rank)
        weightless = a.kind is Kind.BACKWARD_WEIGHT and costs.free_before_w
        if not (weightless or kind_spec(a.kind).background):
            last[a.stage] = max(last.get(a.stage, span.end), span.end)
    out = []
    for stage, (start, rank) in first.items():
        out.append((rank, start, gathered[stage]))
        out.append((rank, last[stage], -gathered[stage]))
    if costs.shard_parameters:
        out += whole_gradient_changes(
            spans, gathered, costs.scatter_each_w, costs.reduce or (), scattering
        )
    return out


def whole_gradient_changes(
    spans: Sequence[Span],
    gradient_bytes: Sequence[float],
    scatter_each_w: bool | None = False,
    reduce: Sequence[float] = (),
    scattering: Mapping[int, frozenset[int]] | None = None,
) -> list[tuple[int, float, float]]:
    """``(rank, time, bytes)`` of each stage's whole weight gradients under sharded
    parameters, as the runtime holds them (:mod:`twobp.schedule.gradient_scatter`).

    A stage that reduce-scatters them at its ``R`` holds them from the start of its first
    ``W`` (or ``B``) to the end of its ``R``'s reduce-scatter (the ``R`` span's end; the
    end of its last ``W`` without an ``R``). One that reduce-scatters them after each
    ``W`` (:func:`~twobp.schedule.gradient_scatter.scattered_each_w` of the rank's
    actions in the order they ran, with ``scatter_each_w``) holds them from the start of
    each ``W`` to the end of its reduce-scatter: the span of ``R`` over the ``W``'s
    micro-batches that the simulator adds (:func:`twobp.sim.result.reductions_met`), or
    ``reduce[stage]`` after the ``W`` (alone on the link) without one. ``scattering``
    gives those stages instead, as agreed among each stage's holders (see
    :func:`memory_timeline`)."""
    by_rank: dict[int, list[Span]] = {}
    for span in sorted(spans, key=lambda s: (s.rank, s.start, s.end)):
        if span.action.kind.is_compute:
            by_rank.setdefault(span.rank, []).append(span)
    out: list[tuple[int, float, float]] = []
    for rank, mine in by_rank.items():
        each = scattered_each_w(
            [s.action for s in mine if s.action.kind is not Kind.REDUCE], scatter_each_w
        )
        if scattering is not None:
            each = scattering.get(rank, frozenset())
        # The spans of each reduce-scatter after a W (as the simulator adds them), and
        # the stage's own R last.
        scattered: dict[tuple[int, tuple[int, ...]], float] = {}
        for span in mine:
            a = span.action
            if a.kind is Kind.REDUCE and a.stage in each:
                key = (a.stage, a.microbatches)
                scattered[key] = max(scattered.get(key, span.end), span.end)
        first: dict[int, float] = {}
        for span in mine:
            a = span.action
            if a.stage >= len(gradient_bytes) or not gradient_bytes[a.stage]:
                continue
            size = gradient_bytes[a.stage]
            if a.stage in each and a.kind in SCATTERING:
                if a.stage in first:  # a B's gradients, sent with this W's
                    out.append((rank, first.pop(a.stage), size))
                    out.append((rank, span.start, -size))
                sent = scattered.get((a.stage, a.microbatches))
                if sent is None:
                    sent = span.end + (reduce[a.stage] if a.stage < len(reduce) else 0.0)
                out.append((rank, span.start, size))
                out.append((rank, sent, -size))
            elif a.kind in MAKES_GRADIENTS:
                first.setdefault(a.stage, span.start)
            elif a.kind is Kind.REDUCE and a.stage in first:
                out.append((rank, first.pop(a.stage), size))
                out.append((rank, span.end, -size))
        ends = {s.action.stage: s.end for s in mine if s.action.kind in MAKES_GRADIENTS}
        for stage, start in first.items():
            out.append((rank, start, gradient_bytes[stage]))
            out.append((rank, ends[stage], -gradient_bytes[stage]))
    return out


def peak_memory(
    spans: Sequence[Span],
    costs: CostModel,
    placement: Sequence[int],
    scattering: Mapping[int, frozenset[int]] | None = None,
) -> tuple[float, ...]:
    """The most memory each rank holds at any time (see :func:`memory_timeline`).

    Returns:
        One peak per rank, indexed by rank.
    """
    timeline = memory_timeline(spans, costs, placement, scattering)
    return tuple(max(b for _, b in timeline[r]) for r in sorted(timeline))


def microbatch_limit(schedule: Schedule, costs: CostModel, memory_limit: float) -> int:
    """The most micro-batches per rank that keep every rank within ``memory_limit``.

    Each rank holds its stages' parameters all the time and, per micro-batch
    between its ``F`` and its ``W``, its activations (until ``I``) or its
    stored derivatives (from ``I``), whichever is larger, of its largest
    stage (the simulator's memory model).

    Args:
        schedule: the schedule (its placement says which stages share a rank).
        costs: the cost model fitted to the schedule's stages.
        memory_limit: memory per rank, in the cost model's unit.

    Returns:
        The largest count that fits on every rank; 0 if not even one does.
    """
    counts = []
    for rank in range(schedule.n_ranks):
        fixed, per_mb = _rank_memory(schedule, costs, rank)
        room = memory_limit - fixed
        if room < 0:
            counts.append(0)  # the parameters alone do not fit
        else:
            counts.append(schedule.n_microbatches if per_mb <= 0 else math.floor(room / per_mb))
    return max(0, min(counts))


def least_fill_memory(schedule: Schedule, costs: CostModel) -> float:
    """The least memory per rank under which the 2BP ``fill`` policy can run ``schedule``.

    ``fill`` places only the ``W`` passes; the order of ``F`` and ``I`` (or
    ``B``) alone keeps up to some number of micro-batches between their ``F``
    and their ``I`` on a rank, whatever the ``W`` placement. This is what
    that number takes on every rank, in the cost model's unit and with the
    model of :func:`microbatch_limit`, which reaches that number exactly
    when its ``memory_limit`` is at least this much.

    Args:
        schedule: the schedule, before the ``W`` are placed.
        costs: the cost model fitted to the schedule's stages.
    """
    held = max((_most_before_input(acts) for acts in schedule.actions.values()), default=0)
    need = 0.0
    for rank in range(schedule.n_ranks):
        fixed, per_mb = _rank_memory(schedule, costs, rank)
        need = max(need, fixed + held * per_mb)
    return need


def fill_limit(schedule: Schedule, costs: CostModel, memory_limit: float) -> int:
    """The micro-batches each rank may hold for ``fill`` within ``memory_limit``.

    :func:`microbatch_limit`, checked against what the order of F and I
    needs whatever the W placement (:func:`least_fill_memory`).

    Raises:
        ValueError: if not one micro-batch fits, or the order of F and I alone
            needs more than the limit (saying how much).
    """
    held = microbatch_limit(schedule, costs, memory_limit)
    if held < 1:
        raise ValueError(f"not one micro-batch fits in {format_amount(memory_limit)} per rank")
    need = least_fill_memory(schedule, costs)
    if memory_limit < need:
        raise ValueError(
            f"needs at least {format_amount(need)} per rank, whatever the W placement (its "
            f"order of F and I alone); the limit is {format_amount(memory_limit)}"
        )
    return held


def _entry_bytes(entry: MemoryChange, action: Action, costs: CostModel) -> float:
    """The bytes one memory entry of the kind table moves for ``action``."""
    sizes: PerStage | None = getattr(costs, entry.pool)
    assert sizes is not None, f"the cost model has no {entry.pool}"
    count = len(action.microbatches)
    cap: int | None = getattr(costs, entry.cap) if entry.cap is not None else None
    return (count if cap is None else min(cap, count)) * sizes[action.stage]


def _rank_memory(schedule: Schedule, costs: CostModel, rank: int) -> tuple[float, float]:
    """What a rank holds all the time, and per micro-batch of its largest stage.

    A held micro-batch is in one pool of the kind table at a time (its
    activations, then its stored derivatives): the largest of them counts.
    """
    assert costs.parameter_bytes is not None
    sizes = [getattr(costs, pool) for pool in held_pools()]
    assert all(size is not None for size in sizes)
    stages = [s for s, r in enumerate(schedule.placement) if r == rank]
    optimizer = costs.optimizer_bytes or (0.0,) * costs.n_stages
    fixed = sum(costs.parameter_bytes[s] + optimizer[s] for s in stages)
    per_mb = max((size[s] for size in sizes for s in stages), default=0.0)
    return fixed, per_mb


def _most_before_input(actions: Sequence[Action]) -> int:
    """The most micro-batches whose ``F`` has run and whose ``I`` (or ``B``) has not:
    those whose activations (the table's ``activation_bytes``) are held."""
    return max([0, *accumulate(a.held_change(ACTIVATIONS) for a in actions)])
