"""The dependency rules: what an action requires and produces, read from the kind table.

A result is named by a key ``(stage, tag, micro-batch)``; the tags and the
rules of each kind are in :mod:`twobp.schedule.kinds`. In a lowered schedule
(one with transfer actions) a result made on another rank reaches its
consumer through the receive the table names (``via``); otherwise the
consumer waits for the result itself, and the walker adds the transfer time.

:func:`index_producers` says where each result is made, for the walker and
for error messages. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from twobp.schedule.action import Action
from twobp.schedule.errors import ScheduleError
from twobp.schedule.kinds import KINDS, kind_spec
from twobp.schedule.schedule import Schedule, StageGraph

Key = tuple[int, str, int]
"""A result of an action: ``(stage, tag, micro-batch)``."""


def is_lowered(schedule: Schedule) -> bool:
    """True if the schedule carries transfer actions."""
    return any(not a.kind.is_compute for acts in schedule.actions.values() for a in acts)


def produces(action: Action) -> tuple[Key, ...]:
    """The results that ``action`` makes available once it has run."""
    return tuple(
        (action.stage, tag, m) for tag in kind_spec(action.kind).makes for m in action.microbatches
    )


def requires(action: Action, graph: StageGraph, lowered: bool) -> tuple[Key, ...]:
    """The results that must exist before ``action`` can run.

    Args:
        action: the action.
        graph: the rank of each stage and the pipelines they form; a need on
            a stage of another pipeline (past an end of the action's own) is
            no need.
        lowered: whether transfers between ranks go through transfer
            actions (then the consumer waits for its receive).

    Returns:
        The keys of the required results, in the order of the table's needs.
    """
    s = action.stage
    out: list[Key] = []
    for need in kind_spec(action.kind).needs:
        other = graph.neighbour(s, need.offset)
        if other is None:
            continue
        via = need.via if lowered and graph.placement[other] != graph.placement[s] else None
        for m in action.microbatches:
            out.append((other, need.tag, m) if via is None else (s, via, m))
    return tuple(out)


def index_producers(schedule: Schedule, lowered: bool) -> dict[Key, tuple[int, int]]:
    """Where each result is made: ``key -> (rank, index in the rank's list)``.

    Args:
        schedule: the schedule.
        lowered: whether transfer actions count (otherwise only compute does).

    Raises:
        ScheduleError: if two actions make the same result (the same work
            listed twice); the message names both places.
    """
    producer: dict[Key, tuple[int, int]] = {}
    for rank in sorted(schedule.actions):
        for step, action in enumerate(schedule.actions[rank]):
            if not (lowered or action.kind.is_compute):
                continue
            for key in produces(action):
                if key in producer:
                    other_rank, other_step = producer[key]
                    raise ScheduleError(
                        f"rank {rank} step {step} ({action}) repeats work already listed at rank "
                        f"{other_rank} step {other_step} (micro-batch {key[2]} of stage {key[0]}); "
                        "each action of a micro-batch must appear once"
                    )
                producer[key] = (rank, step)
    return producer


def describe(key: Key) -> str:
    """A key in action text, e.g. ``1I3 or 1B3`` for an input gradient."""
    stage, tag, m = key
    makers = [
        f"a {stage}{code} covering micro-batch {m}" if spec.several else f"{stage}{code}{m}"
        for code, spec in KINDS.items()
        if tag in spec.makes
    ]
    return " or ".join(makers) or f"{stage}{tag}{m}"


def describe_wait(key: Key, where: Mapping[Key, tuple[int, int]]) -> str:
    """What a stuck action waits for, and where that is listed, for deadlock messages.

    Args:
        key: the missing result.
        where: ``key -> (rank, index in the rank's list)`` of the action making it.

    Returns:
        e.g. ``1I0 or 1B0 (rank 1, its action #3, not run yet)``, or
        ``0F1, which no rank lists``.
    """
    if key in where:
        rank, index = where[key]
        return f"{describe(key)} (rank {rank}, its action #{index}, not run yet)"
    return f"{describe(key)}, which no rank lists"
