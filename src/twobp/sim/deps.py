"""What an action waits for and what it produces, shared by both simulators.

:func:`twobp.sim.simulate.simulate` (fixed durations) and
:func:`twobp.sim.contention.simulate_shared` (ranks that slow each other)
start an action on the same condition. The rules are those of
:mod:`twobp.schedule.dependencies` (the same that validation and the 2BP
transform use), with a transfer delay where a result crosses ranks:

* ``F`` of stage ``s`` needs the forward output of stage ``s - 1`` for the
  same micro-batch (plus the transfer time if that stage is on another rank);
* ``I`` or ``B`` of stage ``s`` needs its own ``F`` and the input gradient
  produced by ``I``/``B`` of stage ``s + 1`` (plus the transfer time); the
  last stage needs only its own ``F``;
* ``W`` needs the ``I`` of every micro-batch it covers, on its stage.

Communication markers of a lowered schedule take no time and are skipped:
transfers are modelled by their delay. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from twobp.schedule.action import Action
from twobp.schedule.dependencies import Key, describe_wait, produces, requires
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel

__all__ = [
    "DeadlockError",
    "Key",
    "check_stage_count",
    "deadlock_message",
    "dependencies",
    "index_producers",
    "products",
]


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
    for key in requires(action, schedule.placement, lowered=False):
        other = key[0]
        if other == s or schedule.rank_of(other) == rank:
            yield key, 0.0
        else:
            # A forward output of stage s - 1 or an input gradient of stage
            # s + 1: either way it crosses boundary min(s, other) -> max(...).
            yield key, costs.transfer_time(min(s, other))


def products(action: Action) -> tuple[Key, ...]:
    """What ``action`` produces when it ends."""
    return produces(action)


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
                        f"{other_rank} step {other_step} (micro-batch {key[2]} of stage {key[0]}); "
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
        waits = [describe_wait(k, producer) for k in missing]
        lines.append(
            f"  rank {rank} is stuck at {action} (its action #{step}): waits for "
            + "; ".join(waits)
        )
    lines.append(
        "Reorder the actions so that each one comes after the actions it needs, "
        "or add the missing ones (check the schedule with twobp.schedule.validate)."
    )
    return "\n".join(lines)
