"""Handcrafted Zero Bubble schedules (Qi et al. 2023): ZB-H1, ZB-H2 and ZB-V.

They are natively split: every backward is an ``I`` (backward-p1) followed,
later, by a ``W`` (backward-p2), and the ``W`` fill what would be bubbles.

``zb-h1``: 1F1B's order of ``F`` and ``I`` (rank ``r`` warms up with
``p - 1 - r`` forwards, then ``F, I`` pairs), with the ``W`` of rank ``r``
lagging ``r`` backward passes behind, which fills the cool-down. At most
``p - r`` forwards wait for their ``I`` on rank ``r``, as in 1F1B; counting
until ``W``, every rank holds up to ``p``, the peak of 1F1B's rank 0. This is
the order of ``torch.distributed.pipelining``'s ``ScheduleInterleavedZeroBubble``
with one stage per rank. For ``p = 2``, ``m = 3``::

    rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
    rank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2

``zb-h2``: more warm-up forwards, ``2 (p - 1 - r) + 1`` on rank ``r``, so
that no rank waits for its first gradient; then ``I, F, W`` triples with the
``W`` lagging ``2 r`` backward passes behind. Up to ``2p - 1`` forwards wait
for their ``I`` on rank 0 (more memory than 1F1B, less bubble).

``zb-v``: two stages per rank in a V: rank ``r`` holds stage ``r`` and stage
``2p - 1 - r``, so the last stage is on rank 0 and the loss is computed where
the data enters. The order is the paper's handcrafted ZB-V (and that of
``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble``); its peak of
activations per rank matches 1F1B's.

This module imports no torch.
"""

from __future__ import annotations

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule

F, I, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741


def _lagged(stage: int, warmup: int, n_microbatches: int, lag: int, pattern: str) -> list[Action]:
    """One rank's list: ``warmup`` forwards, then for each backward ``k`` the
    steps of ``pattern`` (``F`` the next forward if any, ``I`` backward ``k``,
    ``W`` the oldest weight pass once ``k >= lag``), then the remaining ``W``."""
    acts = [Action(stage, F, (m,)) for m in range(warmup)]
    next_forward = warmup
    next_weight = 0
    for k in range(n_microbatches):
        for step in pattern:
            if step == "F" and next_forward < n_microbatches:
                acts.append(Action(stage, F, (next_forward,)))
                next_forward += 1
            elif step == "I":
                acts.append(Action(stage, I, (k,)))
            elif step == "W" and k >= lag:
                acts.append(Action(stage, W, (next_weight,)))
                next_weight += 1
    acts += [Action(stage, W, (m,)) for m in range(next_weight, n_microbatches)]
    return acts


def zb_h1(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's memory, the ``W`` of rank ``r`` delayed by ``r`` steps.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m`` (any ``m >= 1``).

    Returns:
        The schedule, named ``"zb-h1"``.
    """
    p, m = n_ranks, n_microbatches
    actions = {r: tuple(_lagged(r, min(p - 1 - r, m), m, r, "FIW")) for r in range(p)}
    return Schedule(tuple(range(p)), m, actions, "zb-h1")


def zb_h2(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-H2: a deeper warm-up (up to ``2p - 1`` forwards) for less bubble.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m`` (any ``m >= 1``).

    Returns:
        The schedule, named ``"zb-h2"``.
    """
    p, m = n_ranks, n_microbatches
    actions = {r: tuple(_lagged(r, min(2 * (p - 1 - r) + 1, m), m, 2 * r, "IFW")) for r in range(p)}
    return Schedule(tuple(range(p)), m, actions, "zb-h2")


class _Counted:
    """A rank's action list under construction; each (stage, kind) takes the
    micro-batches in order 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[int, Kind], int] = {}

    def count(self, stage: int, kind: Kind) -> int:
        return self._next.get((stage, kind), 0)

    def run(self, stage: int, *kinds: Kind) -> None:
        for kind in kinds:
            self.actions.append(Action(stage, kind, (self.count(stage, kind),)))
            self._next[(stage, kind)] = self.count(stage, kind) + 1


def v_placement(n_ranks: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s`` for ``s < p`` and on rank ``2p - 1 - s`` after."""
    return tuple(s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(2 * n_ranks))


def zb_v(n_ranks: int, n_microbatches: int) -> Schedule:
    """ZB-V: two stages per rank in a V shape, ``I`` and ``W`` interleaved.

    The handcrafted order is built for ``max(m, 2p - 1)`` micro-batches and
    the actions of micro-batches ``>= m`` are then dropped, which keeps it
    deadlock-free for any ``m >= 1``.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m``.

    Returns:
        The schedule, named ``"zb-v"``.
    """
    p, m = n_ranks, n_microbatches
    n = max(m, 2 * p - 1)
    actions: dict[int, tuple[Action, ...]] = {}
    for r in range(p):
        down, up = r, 2 * p - 1 - r  # the rank's stage going down the V, and back up
        rank = _Counted()
        for _ in range(2 * (p - r) - 1):
            rank.run(down, F)
        for _ in range(r):
            rank.run(up, F)
            rank.run(down, F)
        for _ in range(p - r):
            rank.run(up, F, I, W)
        while rank.count(up, F) < rank.count(down, F) or rank.count(down, F) < n:
            if rank.count(down, F) < n:
                rank.run(down, F)
            rank.run(down, I, W)
            rank.run(up, F, I, W)
        for _ in range(r):
            rank.run(down, I)
            rank.run(up, I)
        for _ in range(p - r):
            rank.run(down, I, W)
        while rank.count(up, W) < rank.count(up, I):
            rank.run(up, W)
        while rank.count(down, W) < rank.count(down, I):
            rank.run(down, W)
        actions[r] = tuple(a for a in rank.actions if a.microbatch < m)
    return Schedule(v_placement(p), m, actions, "zb-v")
