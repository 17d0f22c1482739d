"""Lowering passes: add communication, merge a split backward back into ``B``.

Both are pure: a schedule in, a new schedule out.

:func:`add_communication` inserts the transfers between ranks, named as in
``torch.distributed.pipelining`` (the action's stage is the one on the rank
that runs it)::

    rank 0: 0F0 0SEND_F0 ...          0RECV_B0 0B0
    rank 1:       1RECV_F0 1F0 1B0 1SEND_B0

A send comes right after the action that makes what it sends, a receive right
before the action that needs it. Stages on the same rank exchange nothing.

:func:`merge_backward` is the inverse of the 2BP split: each ``I`` becomes a
``B`` where the ``I`` was, and every ``W`` (a concatenated one too) goes away,
since the ``B`` now computes the weight gradient of its micro-batch.
This module imports no torch.
"""

from __future__ import annotations

from twobp.schedule.action import Action, Kind
from twobp.schedule.kinds import KINDS, kind_spec
from twobp.schedule.schedule import Schedule


def add_communication(schedule: Schedule) -> Schedule:
    """Insert ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` for transfers between ranks.

    Communication actions already present are replaced, so the pass can be
    run twice.

    Args:
        schedule: a schedule (fused or split).

    Returns:
        The lowered schedule, with the same name.
    """
    placement = schedule.placement
    sends = [
        (Kind(code), spec.needs[0].tag, spec.link)
        for code, spec in KINDS.items()
        if spec.link is not None and spec.needs and spec.needs[0].offset == 0
    ]

    def crosses(a: int, b: int) -> bool:
        return 0 <= b < len(placement) and placement[a] != placement[b]

    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        for a in acts:
            if not a.kind.is_compute:
                continue
            spec = kind_spec(a.kind)
            s = a.stage
            # A receive before the action for each need that crosses ranks ...
            for need in spec.needs:
                if need.via is not None and crosses(s, s + need.offset):
                    out.append(Action(s, Kind(need.via), a.microbatches))
            out.append(a)
            # ... and a send after it for each result another rank needs.
            for kind, tag, link in sends:
                if tag in spec.makes and crosses(s, s + link):
                    out.append(Action(s, kind, a.microbatches))
        actions[rank] = out
    return schedule.with_actions(actions)


def merge_backward(schedule: Schedule) -> Schedule:
    """Merge each ``I`` and the ``W`` of its micro-batch back into one ``B``.

    The ``B`` takes the place of the ``I``; all ``W`` are dropped (a
    concatenated ``W`` is split among the ``B`` of its micro-batches).
    A name ending in ``+2bp:<policy>`` loses that suffix, so that
    ``merge_backward(apply_two_bp(s, policy)) == s`` for a fused ``s``.

    Args:
        schedule: a valid schedule, split or not (a fused one is unchanged).

    Returns:
        The fused schedule.
    """
    fused = backwards_as(schedule, Kind.FULL_BACKWARD)
    name, sep, _policy = schedule.name.rpartition("+2bp:")
    return fused.with_actions(fused.actions, name if sep else schedule.name)


def backwards_as(schedule: Schedule, kind: Kind) -> Schedule:
    """The schedule with every ``I`` and ``B`` turned into ``kind`` and every ``W`` removed.

    Args:
        schedule: any schedule.
        kind: ``Kind.FULL_BACKWARD`` (fuse) or ``Kind.BACKWARD_INPUT`` (the
            input passes of a split schedule whose ``W`` are placed again).

    Returns:
        The schedule, same name; forwards and communication keep their order.
    """
    backward = (Kind.BACKWARD_INPUT, Kind.FULL_BACKWARD)
    actions = {
        r: [
            Action(a.stage, kind, a.microbatches) if a.kind in backward else a
            for a in acts
            if a.kind is not Kind.BACKWARD_WEIGHT
        ]
        for r, acts in schedule.actions.items()
    }
    return schedule.with_actions(actions)
