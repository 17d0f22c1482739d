"""What an action waits for and what it produces, shared by both simulators.

:func:`twobp.sim.simulate.simulate` (fixed durations) and
:func:`twobp.sim.contention.simulate_shared` (ranks that slow each other)
start an action on the same condition, so the rules live here once:

* ``F`` of stage ``s`` needs the forward output of stage ``s - 1`` for the
  same micro-batch (plus the transfer time if that stage is on another rank);
* ``I`` or ``B`` of stage ``s`` needs its own ``F`` and the input gradient
  produced by ``I``/``B`` of stage ``s + 1`` (plus the transfer time); the
  last stage needs only its own ``F``;
* ``W`` needs the ``I`` of every micro-batch it covers, on its stage.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel

# What an action produces, as (what, stage, micro-batch): "F" a forward output,
# "G" the gradient with respect to the stage's input (from I or B), "I" the
# stored derivatives of a backward-input that the weight pass consumes.
Key = tuple[str, int, int]


class DeadlockError(RuntimeError):
    """The schedule cannot finish: some rank waits for something that never comes."""


def check_stage_count(schedule: Schedule, costs: CostModel) -> None:
    """Raise if ``costs`` does not have one entry per stage of ``schedule``.

    Raises:
        ValueError: naming both counts and the call that fits the model.
    """
    if costs.n_stages != schedule.n_stages:
        raise ValueError(
            f"the cost model has {costs.n_stages} stages but schedule "
            f"{schedule.name or ''!r} has {schedule.n_stages}; fit it with "
            f"costs.for_stages({schedule.n_stages})"
        )


def dependencies(
    action: Action, schedule: Schedule, costs: CostModel
) -> Iterator[tuple[Key, float]]:
    """What ``action`` waits for, and the transfer delay after each is produced.

    Args:
        action: a compute action of ``schedule``.
        schedule: the schedule (for the placement of stages on ranks).
        costs: the cost model (for transfer times).

    Returns:
        An iterator of ``(key, delay)``: the action may start ``delay`` after
        ``key`` is produced.
    """
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


def products(action: Action) -> tuple[Key, ...]:
    """What ``action`` produces when it ends."""
    s = action.stage
    if action.kind is Kind.FORWARD:
        return (("F", s, action.microbatch),)
    if action.kind is Kind.BACKWARD_INPUT:
        return (("G", s, action.microbatch), ("I", s, action.microbatch))
    if action.kind is Kind.FULL_BACKWARD:
        return (("G", s, action.microbatch),)
    return tuple(("W", s, m) for m in action.microbatches)


def index_producers(schedule: Schedule) -> dict[Key, tuple[int, int]]:
    """Where each product is made: ``key -> (rank, step)``.

    Raises:
        ValueError: if two compute actions produce the same thing (the same
            work listed twice); the message names both places.
    """
    producer: dict[Key, tuple[int, int]] = {}
    for rank in sorted(schedule.actions):
        for step, action in enumerate(schedule.actions[rank]):
            if not action.kind.is_compute:
                continue
            for key in products(action):
                if key in producer:
                    other_rank, other_step = producer[key]
                    raise ValueError(
                        f"rank {rank} step {step} ({action}) repeats work already listed at rank "
                        f"{other_rank} step {other_step} (micro-batch {key[2]} of stage {key[1]}); "
                        "each F, I, B and W of a micro-batch must appear once"
                    )
                producer[key] = (rank, step)
    return producer


def deadlock_message(
    schedule: Schedule,
    costs: CostModel,
    stuck: list[int],
    position: Mapping[int, int],
    ends: Mapping[Key, float],
    producer: Mapping[Key, tuple[int, int]],
) -> str:
    """The text of a :class:`DeadlockError`.

    Args:
        schedule: the schedule that cannot finish.
        costs: its cost model.
        stuck: the ranks that did not reach the end of their list.
        position: per rank, the step it is stuck at.
        ends: the products made so far.
        producer: where each product is listed (:func:`index_producers`).

    Returns:
        One line per stuck rank (the action it is stuck on and what it waits
        for), then what to do.
    """
    lines = [f"schedule {schedule.name or ''!r} deadlocks:"]
    for rank in stuck:
        step = position[rank]
        action = schedule.actions[rank][step]
        missing = [k for k, _ in dependencies(action, schedule, costs) if k not in ends]
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


def _key_text(key: Key) -> str:
    what, stage, mb = key
    if what == "G":
        return f"{stage}I{mb} or {stage}B{mb}"
    return f"{stage}{what}{mb}"
