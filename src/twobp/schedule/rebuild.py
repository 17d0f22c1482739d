"""Which micro-batches rebuild their stash: a pass that marks them in the schedule (no torch).

A split stage keeps, from a micro-batch's ``I`` until its ``W``, what the
``W`` needs (the stash). :func:`mark_rebuilds` turns the ``I`` of chosen
micro-batches into ``IR``, which keeps only the stage's inputs and output
gradients, and their ``W`` into ``WR``, which runs the forward and the input
pass again to rebuild the stash first (:mod:`twobp.schedule.kinds`). A ``W``
over several micro-batches of which some are rebuilt becomes a ``W`` of the
kept ones, then one ``WR`` per rebuilt one, in its place: the kept stashes
are given back before the rebuilt ones are held, one at a time. Everything
else keeps its order. 1F1B on 2 ranks, 4 micro-batches, stage 1 rebuilding
micro-batches 0 and 1::

    rank 1 before:  1F0 1I0 1F1 1I1 1F2 1I2 1F3 1I3 1W0-3
    rank 1 after:   1F0 1IR0 1F1 1IR1 1F2 1I2 1F3 1I3 1W2-3 1WR0 1WR1

:func:`rebuilt_microbatches` reads the choice back from a schedule.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from twobp.schedule.action import Action, Kind
from twobp.schedule.lowering import add_reductions, without_reductions
from twobp.schedule.schedule import Schedule

__all__ = ["mark_rebuilds", "rebuilt_microbatches"]

_INPUTS = (Kind.BACKWARD_INPUT, Kind.BACKWARD_INPUT_REBUILT)
_WEIGHTS = (Kind.BACKWARD_WEIGHT, Kind.BACKWARD_WEIGHT_REBUILD)


def mark_rebuilds(
    schedule: Schedule,
    rebuilt: Mapping[int, Collection[int]],
    last: Collection[tuple[int, int]] = (),
) -> Schedule:
    """The schedule with the stashes of ``rebuilt`` micro-batches rebuilt instead of kept.

    Args:
        schedule: a compute schedule whose rebuilt micro-batches run ``I``
            and ``W`` (marks already there are kept).
        rebuilt: per stage, the micro-batches whose stash is rebuilt.
        last: the ``(stage, micro-batch)`` pairs among them whose ``WR`` runs
            at the end of its rank's step (after its other work, where it holds
            the least) instead of where their ``W`` was.

    Returns:
        The schedule with their ``IR`` and ``WR`` (the same object if
        nothing is to be rebuilt); same name. Its reductions (``R``) are
        placed again, after each reducing stage's last weight pass.

    Raises:
        ValueError: if a chosen micro-batch of a stage has no ``I`` there
            (a fused ``B`` keeps no stash to rebuild).
    """
    chosen = {(s, m) for s, mbs in rebuilt.items() for m in mbs}
    if not chosen:
        return schedule
    deferred = set(last) & chosen
    reducing = {
        a.stage for acts in schedule.actions.values() for a in acts if a.kind is Kind.REDUCE
    }
    found: set[tuple[int, int]] = set()
    actions: dict[int, list[Action]] = {}
    for rank, acts in without_reductions(schedule).actions.items():
        out: list[Action] = []
        at_end: list[Action] = []
        for a in acts:
            if a.kind in _INPUTS and (a.stage, a.microbatch) in chosen:
                found.add((a.stage, a.microbatch))
                out.append(Action(a.stage, Kind.BACKWARD_INPUT_REBUILT, a.microbatches))
            elif a.kind in _WEIGHTS:
                kept = tuple(m for m in a.microbatches if (a.stage, m) not in chosen)
                if len(kept) == len(a.microbatches):
                    out.append(a)
                elif kept:
                    out.append(replace(a, microbatches=kept))
                for m in a.microbatches:
                    if (a.stage, m) in chosen:
                        rebuild = Action(a.stage, Kind.BACKWARD_WEIGHT_REBUILD, (m,))
                        (at_end if (a.stage, m) in deferred else out).append(rebuild)
            else:
                out.append(a)
        actions[rank] = out + at_end
    missing = sorted(chosen - found)
    if missing:
        where = ", ".join(f"stage {s} micro-batch {m}" for s, m in missing)
        raise ValueError(
            f"cannot rebuild the stash of {where}: no I there (a fused B, or a first stage "
            "whose I and W run as one B, keeps no stash); choose micro-batches of split stages"
        )
    marked = schedule.with_actions(actions)
    return add_reductions(marked, reducing) if reducing else marked


def rebuilt_microbatches(schedule: Schedule) -> dict[int, tuple[int, ...]]:
    """Per stage, the micro-batches whose stash the schedule rebuilds (their ``IR``);
    stages that rebuild none are left out."""
    out: dict[int, list[int]] = {}
    for acts in schedule.actions.values():
        for a in acts:
            if a.kind is Kind.BACKWARD_INPUT_REBUILT:
                out.setdefault(a.stage, []).extend(a.microbatches)
    return {s: tuple(sorted(mbs)) for s, mbs in sorted(out.items())}
