"""What each action waits for: the dependency rules shared by validation and timing.

An action *produces* results and *requires* results of other actions. A
result is named by a key ``(stage, tag, micro-batch)`` where ``tag`` is

* ``"F"``  the forward output of the stage,
* ``"BI"`` the gradient with respect to the stage's input (made by ``I`` or ``B``),
* ``"W"``  the weight gradient (made by ``W`` or ``B``),
* ``"SEND_F"``, ``"RECV_F"``, ``"SEND_B"``, ``"RECV_B"``: a transfer step.

The rules (``S`` stages, ``s`` a stage, ``m`` a micro-batch)::

    F(s, m)      needs F(s-1, m)                   (s > 0)
    I/B(s, m)    needs F(s, m) and I/B(s+1, m)     (s < S-1)
    W(s, m...)   needs I(s, m) for every m it covers

Once a schedule carries communication actions (it is *lowered*), a transfer
between two ranks goes through them, and the consumer waits for its receive::

    SEND_F(s, m) needs F(s, m)          RECV_F(s+1, m) needs SEND_F(s, m)
    SEND_B(s, m) needs I/B(s, m)        RECV_B(s-1, m) needs SEND_B(s, m)
    F(s+1, m)    needs RECV_F(s+1, m)   I/B(s-1, m)    needs RECV_B(s-1, m)

Transfers between stages on the same rank need no communication action.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule

Key = tuple[int, str, int]
"""A result of an action: ``(stage, tag, micro-batch)``."""

COMMUNICATION = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


def is_lowered(schedule: Schedule) -> bool:
    """True if the schedule carries communication actions."""
    return any(a.kind in COMMUNICATION for acts in schedule.actions.values() for a in acts)


def produces(action: Action) -> tuple[Key, ...]:
    """The results that ``action`` makes available once it has run."""
    s, kind = action.stage, action.kind
    if kind is Kind.FORWARD:
        return ((s, "F", action.microbatch),)
    if kind is Kind.BACKWARD_INPUT:
        return ((s, "BI", action.microbatch),)
    if kind is Kind.FULL_BACKWARD:
        return ((s, "BI", action.microbatch), (s, "W", action.microbatch))
    if kind is Kind.BACKWARD_WEIGHT:
        return tuple((s, "W", m) for m in action.microbatches)
    return ((s, kind.value, action.microbatch),)


def requires(action: Action, placement: Sequence[int], lowered: bool) -> tuple[Key, ...]:
    """The results that must exist before ``action`` can run.

    Args:
        action: the action.
        placement: the rank of each stage.
        lowered: whether transfers between ranks go through communication
            actions (then the consumer waits for its receive).

    Returns:
        The keys of the required results, in a stable order.
    """
    s, kind = action.stage, action.kind
    n_stages = len(placement)
    if kind is Kind.FORWARD:
        if s == 0:
            return ()
        if lowered and placement[s - 1] != placement[s]:
            return ((s, "RECV_F", action.microbatch),)
        return ((s - 1, "F", action.microbatch),)
    if kind in (Kind.BACKWARD_INPUT, Kind.FULL_BACKWARD):
        m = action.microbatch
        own: Key = (s, "F", m)
        if s == n_stages - 1:
            return (own,)
        if lowered and placement[s + 1] != placement[s]:
            return (own, (s, "RECV_B", m))
        return (own, (s + 1, "BI", m))
    if kind is Kind.BACKWARD_WEIGHT:
        return tuple((s, "BI", m) for m in action.microbatches)
    m = action.microbatch
    if kind is Kind.SEND_F:
        return ((s, "F", m),)
    if kind is Kind.RECV_F:
        return ((s - 1, "SEND_F", m),)
    if kind is Kind.SEND_B:
        return ((s, "BI", m),)
    return ((s + 1, "SEND_B", m),)


def describe(key: Key) -> str:
    """A key in action text, e.g. ``1I3 or 1B3`` for an input gradient."""
    stage, tag, m = key
    if tag == "BI":
        return f"{stage}I{m} or {stage}B{m}"
    if tag == "W":
        return f"a {stage}W covering micro-batch {m} (or {stage}B{m})"
    return f"{stage}{tag}{m}"


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
