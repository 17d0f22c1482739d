"""Event-driven simulation of a schedule under a cost model.

Every rank runs its actions in list order. An action starts as soon as its
rank is free and its inputs are there:

* ``F`` of stage ``s`` needs the forward output of stage ``s - 1`` for the
  same micro-batch (plus the transfer time if that stage is on another rank);
* ``I`` or ``B`` of stage ``s`` needs its own ``F`` and the input gradient
  produced by ``I``/``B`` of stage ``s + 1`` (plus the transfer time); the
  last stage needs only its own ``F``;
* ``W`` needs the ``I`` of every micro-batch it covers, on its stage.

Transfers are asynchronous: they occupy no rank and do not contend, so
``SEND_*``/``RECV_*`` markers in a schedule take no time and are skipped.
A schedule that can never finish (a cycle of waits, or a wait for an action
no rank lists) raises :class:`DeadlockError` naming each stuck rank.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.memory import peak_memory
from twobp.timeline import Span, bubble_ratio, busy_time, makespan

# What an action produces, as (what, stage, micro-batch): "F" a forward output,
# "G" the gradient with respect to the stage's input (from I or B), "I" the
# stored derivatives of a backward-input that the weight pass consumes.
_Key = tuple[str, int, int]


class DeadlockError(RuntimeError):
    """The schedule cannot finish: some rank waits for something that never comes."""


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
    """

    name: str
    spans: tuple[Span, ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_ratios: tuple[float, ...]
    bubble_ratio: float
    peak_memory: tuple[float, ...]

    @property
    def n_ranks(self) -> int:
        """Number of ranks."""
        return len(self.busy)


def _dependencies(
    action: Action, schedule: Schedule, costs: CostModel
) -> Iterator[tuple[_Key, float]]:
    """What ``action`` waits for, and the transfer delay after each is produced."""
    s = action.stage
    rank = schedule.rank_of(s)
    last = schedule.n_stages - 1

    def delay(boundary: int, other_stage: int) -> float:
        return 0.0 if schedule.rank_of(other_stage) == rank else costs.transfer_time(boundary)

    if action.kind is Kind.FORWARD:
        if s > 0:
            yield ("F", s - 1, action.microbatch), delay(s - 1, s - 1)
    elif action.kind in (Kind.BACKWARD_INPUT, Kind.FULL_BACKWARD):
        yield ("F", s, action.microbatch), 0.0
        if s < last:
            yield ("G", s + 1, action.microbatch), delay(s, s + 1)
    elif action.kind is Kind.BACKWARD_WEIGHT:
        for m in action.microbatches:
            yield ("I", s, m), 0.0


def _products(action: Action) -> tuple[_Key, ...]:
    s = action.stage
    if action.kind is Kind.FORWARD:
        return (("F", s, action.microbatch),)
    if action.kind is Kind.BACKWARD_INPUT:
        return (("G", s, action.microbatch), ("I", s, action.microbatch))
    if action.kind is Kind.FULL_BACKWARD:
        return (("G", s, action.microbatch),)
    return tuple(("W", s, m) for m in action.microbatches)


def _key_text(key: _Key) -> str:
    what, stage, mb = key
    if what == "G":
        return f"{stage}I{mb} or {stage}B{mb}"
    return f"{stage}{what}{mb}"


def simulate(schedule: Schedule, costs: CostModel) -> SimResult:
    """Run ``schedule`` on the clock of ``costs``.

    Args:
        schedule: the ordered actions of every rank.
        costs: a cost model with one entry per stage of the schedule (use
            :meth:`CostModel.for_stages` to fit per-rank costs to an
            interleaved schedule).

    Returns:
        The timeline and its figures.

    Raises:
        ValueError: if the cost model has another number of stages, or a rank
            lists the same work twice.
        DeadlockError: if the schedule cannot finish; the message names every
            stuck rank, the action it is stuck on and what it waits for.
    """
    if costs.n_stages != schedule.n_stages:
        raise ValueError(
            f"the cost model has {costs.n_stages} stages but schedule "
            f"{schedule.name or ''!r} has {schedule.n_stages}; fit it with "
            f"costs.for_stages({schedule.n_stages})"
        )
    ranks = sorted(schedule.actions)
    producer: dict[_Key, tuple[int, int]] = {}
    for rank in ranks:
        for step, action in enumerate(schedule.actions[rank]):
            if not action.kind.is_compute:
                continue
            for key in _products(action):
                if key in producer:
                    other_rank, other_step = producer[key]
                    raise ValueError(
                        f"rank {rank} step {step} ({action}) repeats work already listed at rank "
                        f"{other_rank} step {other_step} (micro-batch {key[2]} of stage {key[1]}); "
                        "each F, I, B and W of a micro-batch must appear once"
                    )
                producer[key] = (rank, step)

    ends: dict[_Key, float] = {}
    free_at = dict.fromkeys(ranks, 0.0)
    position = dict.fromkeys(ranks, 0)
    spans: list[Span] = []
    progress = True
    while progress:
        progress = False
        for rank in ranks:
            actions = schedule.actions[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if action.kind.is_compute:
                    start = free_at[rank]
                    waiting = False
                    for key, delay in _dependencies(action, schedule, costs):
                        if key not in ends:
                            waiting = True
                            break
                        start = max(start, ends[key] + delay)
                    if waiting:
                        break
                    end = start + costs.duration(action)
                    spans.append(Span(rank, action, start, end))
                    free_at[rank] = end
                    for key in _products(action):
                        ends[key] = end
                position[rank] += 1
                progress = True

    stuck = [r for r in ranks if position[r] < len(schedule.actions[r])]
    if stuck:
        raise DeadlockError(_deadlock_message(schedule, costs, stuck, position, ends, producer))

    total = makespan(spans)
    busy = tuple(busy_time(spans, r) for r in ranks)
    ratios = tuple(bubble_ratio(spans, r) if spans else 0.0 for r in ranks)
    return SimResult(
        name=schedule.name,
        spans=tuple(sorted(spans, key=lambda s: (s.rank, s.start))),
        makespan=total,
        busy=busy,
        idle=tuple(total - b for b in busy),
        bubble_ratios=ratios,
        bubble_ratio=sum(ratios) / len(ratios),
        peak_memory=peak_memory(spans, costs, schedule.placement),
    )


def _deadlock_message(
    schedule: Schedule,
    costs: CostModel,
    stuck: list[int],
    position: dict[int, int],
    ends: dict[_Key, float],
    producer: dict[_Key, tuple[int, int]],
) -> str:
    lines = [f"schedule {schedule.name or ''!r} deadlocks:"]
    for rank in stuck:
        step = position[rank]
        action = schedule.actions[rank][step]
        missing = [k for k, _ in _dependencies(action, schedule, costs) if k not in ends]
        waits = []
        for key in missing:
            if key in producer:
                r, st = producer[key]
                waits.append(f"{_key_text(key)} (rank {r} step {st}, not run yet)")
            else:
                waits.append(f"{_key_text(key)} (which no rank lists)")
        lines.append(
            f"  rank {rank} is stuck at step {step} ({action}), waiting for {', '.join(waits)}"
        )
    lines.append(
        "Reorder the actions so that each one comes after the actions it needs, "
        "or add the missing ones (check the schedule with twobp.schedule.validate)."
    )
    return "\n".join(lines)
