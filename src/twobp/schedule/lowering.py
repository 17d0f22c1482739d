"""Passes that rewrite a schedule: add communication, merge or fuse backwards, keep parts.

All are pure: a schedule in, a new schedule out. The runtime runs what they
produce, and the simulator and the pictures read the same schedules.

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

from collections.abc import Iterable

from twobp.schedule.action import Action, Kind
from twobp.schedule.kinds import ActionKind, kind_spec
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import needed_by, produced_by


def add_communication(schedule: Schedule) -> Schedule:
    """Insert ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` for transfers between ranks.

    Communication actions already present are replaced, so the pass can be
    run twice. The transfers are those of :mod:`twobp.schedule.transfers`,
    which the runtime posts.

    Args:
        schedule: a schedule (fused or split).

    Returns:
        The lowered schedule, with the same name.
    """
    graph = schedule.graph
    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        for a in acts:
            if not a.kind.is_compute:
                continue
            # A receive before the action for each need that crosses ranks ...
            for kind, transfer in needed_by(a, graph):
                if not transfer.is_local:
                    out.append(Action(a.stage, kind, a.microbatches))
            out.append(a)
            # ... and a send after it for each result another rank needs.
            for kind, transfer in produced_by(a, graph):
                if not transfer.is_local:
                    out.append(Action(a.stage, kind, a.microbatches))
        actions[rank] = out
    return schedule.with_actions(actions)


def compute_only(schedule: Schedule) -> Schedule:
    """The schedule without communication actions (the same object if it has none)."""
    if all(a.kind.is_compute for acts in schedule.actions.values() for a in acts):
        return schedule
    return schedule.with_actions(
        {r: [a for a in acts if a.kind.is_compute] for r, acts in schedule.actions.items()}
    )


def split_stages(schedule: Schedule) -> frozenset[int]:
    """The stages whose backward the schedule splits (those with an ``I`` or a ``W``)."""
    split = {
        Kind.BACKWARD_INPUT,
        Kind.BACKWARD_WEIGHT,
        Kind.BACKWARD_INPUT_REBUILT,
        Kind.BACKWARD_WEIGHT_REBUILD,
    }
    return frozenset(a.stage for acts in schedule.actions.values() for a in acts if a.kind in split)


def is_split(schedule: Schedule) -> bool:
    """True if the schedule has ``I`` or ``W`` actions."""
    return bool(split_stages(schedule))


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule with only its ``F`` actions (evaluation without backward)."""
    return schedule.with_actions(
        {r: [a for a in acts if a.kind is Kind.FORWARD] for r, acts in schedule.actions.items()},
        name=f"{schedule.name}:forward" if schedule.name else "forward",
    )


def fuse_first_stage_backward(schedule: Schedule, *, out_of_groups: bool = False) -> Schedule:
    """Run a first stage's ``I`` directly followed by its own ``W`` as one ``B``.

    Nobody waits for the first stage's input gradient (there is no stage
    before it). Where the schedule puts ``Wk`` right after ``Ik`` of stage 0,
    one full backward does the same work with the weight gradients computed
    while their operands are still in cache.

    Args:
        schedule: a compute-only schedule.
        out_of_groups: also every ``Ik`` of a first stage after which its rank runs
            nothing but that stage's ``I`` and ``W`` (its cool-down): ``Ik`` becomes
            ``Bk`` and ``k`` leaves the ``W`` that held it (``0I6 0I7 0W0-7`` becomes
            ``0B6 0B7 0W0-5``). Deferring those ``W`` lets no other action of the
            rank run earlier; the ``dynamic`` policy would run them in the waits for
            the next ``I``, where the fused ``B`` (cheaper than ``I`` and ``W`` apart)
            runs as well.

    Returns:
        The schedule with each such pair replaced by a ``B`` (and, with
        ``out_of_groups``, the cool-down's ``I`` by ``B``); same name.
    """
    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        skip = False
        for here, after in zip(acts, [*acts[1:], None], strict=False):
            if skip:
                skip = False
                continue
            if (
                after is not None
                and schedule.model_stage(here.stage) == 0
                and here.kind is Kind.BACKWARD_INPUT
                and after.kind is Kind.BACKWARD_WEIGHT
                and after.stage == here.stage
                and after.microbatches == here.microbatches
            ):
                out.append(Action(here.stage, Kind.FULL_BACKWARD, here.microbatches))
                skip = True
            else:
                out.append(here)
        actions[rank] = _fused_cool_down(schedule, out) if out_of_groups else out
    if all(tuple(out) == schedule.actions[r] for r, out in actions.items()):
        return schedule
    return schedule.with_actions(actions)


def _fused_cool_down(schedule: Schedule, actions: list[Action]) -> list[Action]:
    """``actions`` with the ``I`` of a first stage's cool-down (the end of the list where
    the rank runs only that stage's ``I`` and ``W``) as ``B``, out of their ``W``."""
    start = len(actions)
    while (
        start > 0
        and actions[start - 1].stage == actions[-1].stage
        and schedule.model_stage(actions[start - 1].stage) == 0
        and actions[start - 1].kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
    ):
        start -= 1
    fused = {a.microbatch for a in actions[start:] if a.kind is Kind.BACKWARD_INPUT}
    tail: list[Action] = []
    for action in actions[start:]:
        if action.kind is Kind.BACKWARD_INPUT:
            tail.append(Action(action.stage, Kind.FULL_BACKWARD, action.microbatches))
            continue
        rest = tuple(mb for mb in action.microbatches if mb not in fused)
        if rest:
            tail.append(Action(action.stage, action.kind, rest))
    return actions[:start] + tail


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


def merge_stages(schedule: Schedule, stages: Iterable[int]) -> Schedule:
    """:func:`merge_backward` of ``stages`` only: their ``I`` become ``B``, their ``W`` go.

    The other stages keep their ``I`` and ``W`` where they are: a schedule
    that splits the backward where 2BP pays and fuses it elsewhere.

    Args:
        schedule: a valid schedule.
        stages: the stages (of the schedule, all pipelines) whose backward is fused.

    Returns:
        The schedule, same name (the same object if none of ``stages`` is split).
    """
    fused = frozenset(stages) & split_stages(schedule)
    if not fused:
        return schedule
    return backwards_as(schedule, Kind.FULL_BACKWARD, fused)


def backwards_as(schedule: Schedule, kind: Kind, stages: Iterable[int] | None = None) -> Schedule:
    """The schedule with every ``I`` and ``B`` turned into ``kind`` and every ``W`` removed
    (the rebuilding ``IR`` and ``WR`` alike: what is rebuilt is chosen again).

    Args:
        schedule: any schedule.
        kind: ``Kind.FULL_BACKWARD`` (fuse) or ``Kind.BACKWARD_INPUT`` (the
            input passes of a split schedule whose ``W`` are placed again).
        stages: only the actions of these stages (None: every stage).

    Returns:
        The schedule, same name; forwards and communication keep their order.
    """
    backward = (Kind.BACKWARD_INPUT, Kind.BACKWARD_INPUT_REBUILT, Kind.FULL_BACKWARD)
    weights = (Kind.BACKWARD_WEIGHT, Kind.BACKWARD_WEIGHT_REBUILD)
    chosen = None if stages is None else frozenset(stages)
    actions = {
        r: [
            Action(a.stage, kind, a.microbatches) if a.kind in backward and mine else a
            for a in acts
            for mine in (chosen is None or a.stage in chosen,)
            if not (a.kind in weights and mine)
        ]
        for r, acts in schedule.actions.items()
    }
    return schedule.with_actions(actions)


def add_reductions(schedule: Schedule, stages: Iterable[int] | None = None) -> Schedule:
    """Put a gradient reduction ``R`` right after each stage's last weight gradient.

    ``R`` of stage ``s`` covers every micro-batch of its pipeline; it
    starts, in the background, once the stage's last ``W`` (or ``B``) is
    done. Reductions already present are replaced.

    Args:
        schedule: a compute schedule (fused or split), lowered or not.
        stages: the stages that reduce (those held by several ranks); None: every stage.

    Returns:
        The schedule with its reductions, under the same name.
    """
    wanted = set(range(schedule.n_stages) if stages is None else stages)
    actions: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        kept = [a for a in acts if a.kind is not Kind.REDUCE]
        last = {a.stage: i for i, a in enumerate(kept) if makes_weight_gradients(a.kind)}
        out: list[Action] = []
        for i, a in enumerate(kept):
            out.append(a)
            if a.stage in wanted and last.get(a.stage) == i:
                out.append(Action(a.stage, Kind.REDUCE, tuple(schedule.microbatches_of(a.stage))))
        actions[rank] = out
    return schedule.with_actions(actions)


def makes_weight_gradients(kind: ActionKind) -> bool:
    """True if actions of ``kind`` make weight gradients (the tag ``W``: ``W`` and ``B``),
    by the kind table."""
    return "W" in kind_spec(kind).makes


def without_reductions(schedule: Schedule) -> Schedule:
    """The schedule without gradient reductions (the same object if it has none)."""
    if not has_reductions(schedule):
        return schedule
    return schedule.with_actions(
        {r: [a for a in acts if a.kind is not Kind.REDUCE] for r, acts in schedule.actions.items()}
    )


def has_reductions(schedule: Schedule) -> bool:
    """True if the schedule lists gradient reductions (``R``)."""
    return any(a.kind is Kind.REDUCE for acts in schedule.actions.values() for a in acts)
