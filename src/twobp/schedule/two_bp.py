"""The 2BP transform: split each backward into ``I`` and ``W`` and place the ``W``.

2-stage backpropagation splits a fused backward ``B`` into backward-p1 ``I``
(the gradient with respect to the stage input, which the previous stage waits
for) and backward-p2 ``W`` (the weight gradient, which nobody waits for), so
``W`` can be moved into time the rank would otherwise spend waiting.
:func:`apply_two_bp` keeps the order of every ``F`` and ``I`` of the input
schedule (a ``B`` becomes an ``I`` where it was) and places the ``W`` by a
policy:

``eager``
    ``W`` right after its ``I``: no ``W`` moves, for comparison (the input
    gradient still leaves after ``I`` instead of after the whole backward).
``paper``
    the placement of the 2BP paper (Rae et al., 2024, Figure 1). Each ``W`` is
    stored; once a rank has no forward left (its cool-down), whenever it
    would wait for the gradient of its next ``I`` it runs its oldest stored
    ``W`` in that idle slot, if the ``W`` fits before the gradient arrives
    under the cost model (unit times ``F = I = W = 1`` by default). What is
    left is run at the end as one concatenated ``W`` per stage (``0W0-7``).
``fill``
    the same, in every idle slot of the whole step rather than only in the
    cool-down, and with ``memory_limit`` a stored ``W`` also runs before a
    forward that would otherwise hold more than ``memory_limit`` micro-batches
    (forwards whose ``W`` has not run) on its rank.
``dynamic``
    no ``W`` in the listed waits: each rank's runtime runs its stored ``W``
    (one layer's weight gradients at a time) while it waits on a receive
    whose data has not arrived, wherever the waits fall in the step that
    runs (see :mod:`twobp.runtime.execution.dynamic_weights`). The list keeps a
    ``W`` only where ``memory_limit`` forces one, and the rest at the end as
    in ``paper``; there each ``W`` runs what the waits left of it.

1F1B with ``p = 4``, ``m = 4``, unit times, ``paper`` policy (``Fk``, ``Ik``,
``Wk``: forward, backward-p1, backward-p2 of micro-batch ``k``; ``W*`` the
concatenated ``W`` of what is left, ``=`` its continuation; ``.`` waiting)::

    time     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    rank 0  F0 F1 F2 F3  .  .  . I0 W0 I1 W1 I2 W2 I3 W3
    rank 1   . F0 F1 F2  .  . I0 F3 I1 W0 I2 W1 I3 W*  =
    rank 2   .  . F0 F1  . I0 F2 I1 F3 I2 W0 I3 W*  =  =
    rank 3   .  .  . F0 I0 F1 I1 F2 I2 F3 I3 W*  =  =  =

    rank 0: 0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3
    rank 1: 1F0 1F1 1F2 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2-3
    rank 2: 2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2I3 2W1-3
    rank 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0-3

The last rank runs all its ``I`` and then one ``W`` over all micro-batches;
ranks further up fill their cool-down waits first (15 time units against 18
for ``eager`` and 21 for the fused 1F1B with ``B = 2``).
With a cost model whose ``W`` over ``k`` micro-batches is cheaper than ``k``
single ones (its ``weight_concat`` table), ``paper`` and ``fill`` put the
largest group of one stage's stored ``W`` that fits into a wait, as one
concatenated ``W`` (``microbatches_per_w`` caps the group).
Schedules that are already split (``zb-*``) keep their ``F``/``I`` order and
get their ``W`` placed again, grouped the same way; ``policy=None`` returns any schedule unchanged.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from types import MappingProxyType

from twobp.schedule._timing import Costs, Timing, make_timing, place_weights
from twobp.schedule.action import Action, Kind
from twobp.schedule.dependencies import is_lowered
from twobp.schedule.kinds import ACTIVATIONS
from twobp.schedule.lowering import add_reductions, backwards_as, without_reductions
from twobp.schedule.schedule import Schedule
from twobp.schedule.validate import validate

TWO_BP_POLICIES: Mapping[str, str] = MappingProxyType(
    {
        "eager": "each W right after its I (no gain; for comparison)",
        "paper": "2BP paper: W fills cool-down waits, the rest runs at the end as one "
        "concatenated W per stage",
        "fill": "each W in the earliest idle slot the cost model predicts, within "
        "memory_limit; the rest concatenated at the end",
        "dynamic": "each W in the waits that happen as the step runs (at run time, one layer "
        "at a time), within memory_limit; the rest concatenated at the end",
    }
)
"""The placement policies of :func:`apply_two_bp`, with one line each."""

DYNAMIC = "dynamic"
"""The policy whose ``W`` the runtime places in the waits it meets."""


def places_weights_at_run_time(schedule: Schedule) -> bool:
    """Whether ``schedule`` was split by the ``dynamic`` policy: its runtime runs stored
    ``W`` in the waits it meets, ahead of where the list puts them."""
    return f"+2bp:{DYNAMIC}" in schedule.name


def placed_at_run_time(schedule: Schedule, timing: Timing) -> Schedule:
    """A ``dynamic`` schedule's ``W`` where its runtime runs them when actions take
    ``timing``'s times: each stored ``W`` in the first wait it fits in (the ``fill``
    rule, on the times as they happen rather than as predicted), else where the list
    holds no more micro-batches than it did (its memory bound), else at the end.

    What the simulator walks for a ``dynamic`` schedule. The runtime does not know
    how long a wait will be: it runs one layer's ``W`` at a time until the data is
    there, so it may overrun a wait by one layer's ``W`` where this fits none in.
    Any other schedule, or one with rebuilt stashes (``IR``, ``WR``), is returned as
    it is.
    """
    kinds = {a.kind for acts in schedule.actions.values() for a in acts}
    if not places_weights_at_run_time(schedule) or is_lowered(schedule) or kinds - _PLACEABLE:
        return schedule
    reduced = {a.stage for acts in schedule.actions.values() for a in acts if a.kind is Kind.REDUCE}
    listed = without_reductions(schedule)
    base = listed.with_actions(
        {
            r: [a for a in acts if a.kind is not Kind.BACKWARD_WEIGHT]
            for r, acts in listed.actions.items()
        }
    )
    bound = max(_peak_held(acts) for acts in listed.actions.values())
    limit = bound if bound < max(_peak_held(acts) for acts in base.actions.values()) else None
    actions = place_weights(base, timing, cooldown_only=False, memory_limit=limit)
    placed = listed.with_actions(actions)
    return add_reductions(placed, reduced) if reduced else placed


_PLACEABLE = frozenset(
    {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD, Kind.REDUCE}
)


def _peak_held(actions: tuple[Action, ...]) -> int:
    """The most micro-batches a rank's ``actions`` hold between ``F`` and ``W`` (or ``B``)."""
    return max(accumulate(a.held_change() for a in actions), default=0)


def apply_two_bp(
    schedule: Schedule,
    policy: str | None = "paper",
    *,
    costs: Costs = None,
    memory_limit: int | None = None,
    microbatches_per_w: int | None = None,
) -> Schedule:
    """Split every backward into ``I`` and ``W`` and place the ``W`` by ``policy``.

    Args:
        schedule: a valid compute-only schedule, fused (``B``) or split.
        policy: one of :data:`TWO_BP_POLICIES`, or ``None`` to return
            ``schedule`` unchanged.
        costs: the times used by ``paper`` and ``fill`` to predict idle slots:
            a cost model with ``duration(action)`` (e.g. ``twobp.sim.CostModel``,
            whose ``transfer_time`` and ``send_overhead`` count too, as the
            simulator counts them), a mapping ``{"F": t, "I": t, "W": t}``
            (times, or lists per stage), or ``None`` for unit times. ``eager`` ignores it.
        memory_limit: for ``fill`` and ``dynamic``, the most micro-batches a rank
            may hold between their ``F`` and their ``W``.
        microbatches_per_w: for ``paper`` and ``fill``, the most micro-batches one
            ``W`` covers (None: no cap). Where the cost model makes a ``W``
            over several micro-batches cheaper than single ones (a
            ``weight_concat`` table), a wait gets the largest group of stored
            ``W`` that fits in it; the rest at the end is split into groups
            of this size.

    Returns:
        The split schedule, named ``"<name>+2bp:<policy>"``. A stage that had
        a gradient reduction ``R`` has it again, after its new last ``W``.

    Raises:
        ValueError: on an unknown policy (the message lists the valid ones), a
            ``memory_limit`` with another policy than ``fill`` or below what the
            ``F``/``I`` order already needs, or a schedule with communication.
        ScheduleError: if ``schedule`` is not valid.
    """
    if policy is None:
        return schedule
    if policy not in TWO_BP_POLICIES:
        raise ValueError(
            f"unknown 2BP policy {policy!r}; valid policies: {', '.join(TWO_BP_POLICIES)} "
            "(or None to keep the schedule as it is)"
        )
    if memory_limit is not None and policy not in ("fill", DYNAMIC):
        raise ValueError(
            f"memory_limit applies to policies 'fill' and 'dynamic' only, not {policy!r}"
        )
    cap = microbatches_per_w
    if cap is not None and cap < 1:
        raise ValueError(f"microbatches_per_w must be at least 1 micro-batch (or None), got {cap}")
    if is_lowered(schedule):
        raise ValueError(
            f"{schedule.name or 'schedule'} has communication actions: apply the 2BP "
            "transform before add_communication"
        )
    validate(schedule)
    reduced = {a.stage for acts in schedule.actions.values() for a in acts if a.kind is Kind.REDUCE}
    base = backwards_as(without_reductions(schedule), Kind.BACKWARD_INPUT)
    if policy == "eager":
        actions = {r: _eager(acts) for r, acts in base.actions.items()}
    else:
        if memory_limit is not None:
            _check_memory_limit(base, memory_limit)
        actions = place_weights(
            base,
            make_timing(costs, base),
            cooldown_only=policy == "paper",
            memory_limit=memory_limit,
            microbatches_per_w=microbatches_per_w,
            forced_only=policy == DYNAMIC,
        )
    group = "" if microbatches_per_w is None or policy == "eager" else f":w{microbatches_per_w}"
    split = schedule.with_actions(actions, f"{schedule.name}+2bp:{policy}{group}")
    return add_reductions(split, reduced) if reduced else split


def _eager(acts: tuple[Action, ...]) -> list[Action]:
    out: list[Action] = []
    for a in acts:
        out.append(a)
        if a.kind is Kind.BACKWARD_INPUT:
            out.append(Action(a.stage, Kind.BACKWARD_WEIGHT, a.microbatches))
    return out


def _check_memory_limit(schedule: Schedule, memory_limit: int) -> None:
    """Raise if the ``F``/``I`` order alone holds more than ``memory_limit``.

    What it holds whatever the ``W`` placement: the micro-batches whose
    activations are held (the kind table's memory entries).
    """
    for rank, acts in schedule.actions.items():
        waiting = list(accumulate(a.held_change(ACTIVATIONS) for a in acts))
        for a, held in zip(acts, waiting, strict=True):
            if held > memory_limit:
                raise ValueError(
                    f"memory_limit={memory_limit} is below what rank {rank} needs: after {a} "
                    f"it holds {held} micro-batches whose I has not run, whatever the W "
                    f"placement; use memory_limit >= {max(waiting)}, or a schedule with a "
                    "shorter warm-up"
                )
