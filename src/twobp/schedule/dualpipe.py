"""DualPipe (DeepSeek-V3) and DualPipeV: two stages per rank, fed from both ends.

Both give each rank two stages, its *near* one (phase 0) and its *far* one
(phase 1), and run on each rank the same eight steps of DeepSeek's DualPipe
(the deepseek-ai/DualPipe repository, and ``ScheduleDualPipeV`` of
``torch.distributed.pipelining``). For rank ``r`` of ``p`` with ``m``
micro-batches per phase, ``F0``/``F1`` a forward of the near/far stage,
``B``/``I`` a fused backward or a backward-p1, ``W`` the oldest stored
backward-p2 (if any)::

    1  F0                  2 (p - 1 - r) times
    2  F0 F1               r + 1
    3  I1 W F1             p - 1 - r        (zero bubble)
    4  F0 B1 F1 B0         m - 2p + r + 1   (the steady state)
    5  B1 F1 B0            p - 1 - r
    6  B1 B0               r + 1            (I from the middle on: zero bubble)
    7  W I0                p - 1 - r
    8  W                   r + 1

DeepSeek overlaps the forward and the backward of each ``F B`` pair of steps
4 and 5 (one chunk's computation hides the other's all-to-all); twobp runs
one action at a time, the forward first, as torch's runtime does.

``dualpipev``: DualPipe cut into a V. Rank ``r`` holds stages ``r`` (near)
and ``2p - 1 - r`` (far) of one copy of the model, the placement of ZB-V; the
loss is computed on rank 0, where the data enters. ``m >= 2p``, as
torch's ``ScheduleDualPipeV`` requires. ``p = 2``, ``m = 4``::

    rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
    rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3

``dualpipe``: the bidirectional schedule. Rank ``r`` holds stage ``r`` of a
"down" pipeline (micro-batches ``0..m/2-1`` enter at rank 0) and stage
``p - 1 - r`` of an "up" one (``m/2..m-1`` enter at rank ``p - 1``); the two
copies of every stage of the model reduce their gradients at the end of the
step (``R``), as Chimera's do. Ranks ``r`` and ``p - 1 - r`` mirror each
other: both run rank ``min(r, p - 1 - r)`` of DualPipeV over ``p / 2``
ranks and ``m / 2`` micro-batches, the near stage being that of the pipeline
entering at their end. The middle ranks pass a micro-batch on to the other
half where DualPipeV turns it around on one rank. ``p`` even, ``m`` even and
``m >= 2p``, as DeepSeek's ``step`` asserts. ``p = 2``, ``m = 4``::

    rank 0: 0F0 3F2 0F1 3B2 3F3 0B0 3B3 0I1 0W1
    rank 1: 2F2 1F0 2F3 1B0 1F1 2B2 1B1 2I3 2W3

As a :class:`~twobp.schedule.schedule.Schedule` it has the
stages of Chimera (:func:`~twobp.schedule.chimera.chimera_placement`): stage
``p + s`` runs the model's stage ``s`` on rank ``p - 1 - s``.

Both are natively split: they list their own ``I`` and ``W``, and their
steady state a fused ``B``. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twobp.schedule.action import Action, Kind
from twobp.schedule.chimera import chimera_placement
from twobp.schedule.schedule import Schedule
from twobp.schedule.zero_bubble import v_placement

F, I, W, B = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.FULL_BACKWARD  # noqa: E741

NEAR, FAR = 0, 1


@dataclass
class _Rank:
    """One rank's list of (phase, kind, index) under construction; each phase
    and kind takes its micro-batches in order 0, 1, 2, ..."""

    steps: list[tuple[int, Kind, int]] = field(default_factory=list)
    _next: dict[tuple[int, Kind], int] = field(default_factory=dict)
    _stored: list[tuple[int, int]] = field(default_factory=list)  # the W after an I

    def run(self, phase: int, kind: Kind) -> None:
        # A B is the I and the W of its micro-batch: it counts as an I.
        counted = I if kind is B else kind
        index = self._next.get((phase, counted), 0)
        self._next[(phase, counted)] = index + 1
        self.steps.append((phase, kind, index))
        if kind is I:
            self._stored.append((phase, index))

    def oldest_weight(self) -> None:
        if self._stored:
            phase, index = self._stored.pop(0)
            self.steps.append((phase, W, index))


def dualpipe_order(n_ranks: int, n_microbatches: int, rank: int) -> list[tuple[int, Kind, int]]:
    """The order of one rank of DualPipeV: (phase, kind, micro-batch of the phase).

    Args:
        n_ranks: ranks of the V ``p``.
        n_microbatches: micro-batches ``m >= 2p``.
        rank: the rank ``r``.

    Returns:
        The rank's actions; phase 0 is its near stage, 1 its far one.
    """
    p, m, r = n_ranks, n_microbatches, rank
    order = _Rank()
    for _ in range(2 * (p - r - 1)):
        order.run(NEAR, F)
    for _ in range(r + 1):
        order.run(NEAR, F)
        order.run(FAR, F)
    for _ in range(p - r - 1):
        order.run(FAR, I)
        order.oldest_weight()
        order.run(FAR, F)
    for _ in range(m - 2 * p + r + 1):
        order.run(NEAR, F)
        order.run(FAR, B)
        order.run(FAR, F)
        order.run(NEAR, B)
    for _ in range(p - r - 1):
        order.run(FAR, B)
        order.run(FAR, F)
        order.run(NEAR, B)
    # The second half of the last backwards is split: their W fill the cool-down.
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        order.run(FAR, I if split else B)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        order.run(NEAR, I if split else B)
    for _ in range(p - r - 1):
        order.oldest_weight()
        order.run(NEAR, I)
    for _ in range(r + 1):
        order.oldest_weight()
    return order.steps


def _check(name: str, n_ranks: int, n_microbatches: int, even: bool) -> None:
    if even and n_ranks % 2:
        raise ValueError(
            f"{name} needs an even number of ranks (rank r holds stage r of the down pipeline "
            f"and stage p-1-r of the up one, and ranks r and p-1-r mirror each other), got "
            f"{n_ranks}"
        )
    if even and n_microbatches % 2:
        raise ValueError(
            f"{name} needs an even number of micro-batches (half go down, half up), got "
            f"{n_microbatches}"
        )
    if n_microbatches < 2 * n_ranks:
        raise ValueError(
            f"{name} needs at least 2p = {2 * n_ranks} micro-batches on {n_ranks} ranks (each "
            f"rank fills its two stages before its steady state), got {n_microbatches}; "
            f"use n_microbatches >= {2 * n_ranks}, or zb-v, whose V takes any count"
        )


def dualpipev(n_ranks: int, n_microbatches: int) -> Schedule:
    """DualPipeV: DualPipe's order on the V of ZB-V (rank ``r`` holds ``r`` and ``2p - 1 - r``).

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m >= 2p``.

    Returns:
        The schedule (natively split), named ``"dualpipev"``.

    Raises:
        ValueError: if ``m < 2p``.
    """
    p, m = n_ranks, n_microbatches
    _check("dualpipev", p, m, even=False)
    actions = {
        r: tuple(
            Action(r if phase == NEAR else 2 * p - 1 - r, kind, (index,))
            for phase, kind, index in dualpipe_order(p, m, r)
        )
        for r in range(p)
    }
    return Schedule(v_placement(p), m, actions, "dualpipev")


def dualpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """DualPipe: two pipelines in opposite directions, each rank runs DualPipeV's order.

    Args:
        n_ranks: number of ranks ``p``, even.
        n_microbatches: micro-batches of the step over both pipelines ``m``,
            even and ``>= 2p``.

    Returns:
        The schedule (natively split), named ``"dualpipe"``, with ``n_pipelines = 2``.

    Raises:
        ValueError: if ``p`` or ``m`` is odd, or ``m < 2p``.
    """
    p, m = n_ranks, n_microbatches
    _check("dualpipe", p, m, even=True)
    half = m // 2
    actions: dict[int, tuple[Action, ...]] = {}
    for r in range(p):
        down = (r, 0)  # the rank's stage of the down pipeline, its first micro-batch
        up = (2 * p - 1 - r, half)
        near, far = (down, up) if r < p // 2 else (up, down)
        acts = []
        for phase, kind, index in dualpipe_order(p // 2, half, min(r, p - 1 - r)):
            stage, first = near if phase == NEAR else far
            acts.append(Action(stage, kind, (first + index,)))
        actions[r] = tuple(acts)
    return Schedule(chimera_placement(p), m, actions, "dualpipe", n_pipelines=2)
