"""Which tensors cross between stages, and in which order each pair of ranks moves them.

The one model of communication: :func:`twobp.schedule.add_communication`
places a send or receive for each transfer that crosses ranks, and the
runtime posts them in the pair orders of :func:`plan_communication`.
Transfers follow from the compute actions:

* ``F`` of stage ``s`` makes the *activation* of boundary ``s -> s+1``;
* ``B`` or ``I`` of stage ``s`` makes the *gradient* of boundary ``s-1 -> s``.

A transfer between stages on the same rank is local (no communication).
Between two ranks, both sides must post their sends and receives in one
common order, or backends that match messages by order (NCCL, which ignores
tags) deadlock. That *pair order* comes from a dry run of the whole schedule
(every rank has it): transfers are ordered by the step in which their
producing action runs. Each rank's sends then follow its own action order.
The runtime carries each direction of a pair on a process group of its own,
in the sender's part of the pair order, so that a receiver may post its
receives ahead in that order without holding back its own sends; where one
group carries both directions, it posts them ahead only up to its next send.

This module imports no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from twobp.schedule.action import Action, Kind
from twobp.schedule.kinds import KINDS, Role, kind_spec
from twobp.schedule.schedule import Schedule, StageGraph
from twobp.schedule.validate import dry_run


class Direction(str, Enum):
    """Which way a transfer goes through a stage boundary."""

    ACTIVATION = "activation"
    """Forward output of stage ``s`` to stage ``s+1``."""
    GRADIENT = "gradient"
    """Input gradient of stage ``s+1`` back to stage ``s``."""


@dataclass(frozen=True)
class Transfer:
    """The tensors of one micro-batch crossing one stage boundary.

    Args:
        direction: activation (forward) or gradient (backward).
        boundary: the lower stage of the boundary (``s`` for ``s <-> s+1``).
        microbatch: the micro-batch.
        src: rank that produces it.
        dst: rank that consumes it (equal to ``src`` for a local transfer).
    """

    direction: Direction
    boundary: int
    microbatch: int
    src: int
    dst: int

    @property
    def is_local(self) -> bool:
        """True if producer and consumer stages are on the same rank."""
        return self.src == self.dst

    @property
    def key(self) -> tuple[Direction, int, int]:
        """What identifies it within a step: (direction, boundary, micro-batch)."""
        return (self.direction, self.boundary, self.microbatch)

    def __str__(self) -> str:
        lo, hi = self.boundary, self.boundary + 1
        arrow = (
            f"stage {lo} -> stage {hi}"
            if self.direction is Direction.ACTIVATION
            else (f"stage {hi} -> stage {lo}")
        )
        return (
            f"{self.direction.value} of micro-batch {self.microbatch} ({arrow}, "
            f"rank {self.src} -> rank {self.dst})"
        )


@dataclass(frozen=True)
class PairOp:
    """One send or receive in a pair order."""

    is_send: bool
    transfer: Transfer


@dataclass(frozen=True)
class CommPlan:
    """The communication of one rank for one step.

    Args:
        rank: the rank this plan is for.
        peers: for each peer rank, this rank's sends to and receives from it,
            in the pair order that both ranks follow.
    """

    rank: int
    peers: Mapping[int, tuple[PairOp, ...]]


def needed_transfer(action: Action, graph: StageGraph) -> Transfer | None:
    """The transfer ``action`` consumes (local or remote), or None.

    ``F`` of stage ``s > 0`` consumes the activation from ``s-1``; ``B``/``I``
    of a stage before the last consume the gradient from ``s+1`` (stages of
    the same pipeline, when the schedule has several).
    """
    found = needed_by(action, graph)
    return found[0][1] if found else None


def needed_by(action: Action, graph: StageGraph) -> list[tuple[Kind, Transfer]]:
    """Each transfer ``action`` consumes, with the receive kind that carries it across ranks.

    Read from the table of kinds: the needs that a receive carries (``via``)
    from another stage that exists.
    """
    s = action.stage
    out = []
    for need in kind_spec(action.kind).needs:
        other = graph.neighbour(s, need.offset)
        if need.via is not None and need.offset != 0 and other is not None:
            out.append((Kind(need.via), _between(s, other, action.microbatch, graph, into=s)))
    return out


def produced_transfer(action: Action, graph: StageGraph) -> Transfer | None:
    """The transfer ``action`` produces (local or remote), or None.

    Read from the table: a result of ``action`` that a send kind carries to
    a stage that exists.
    """
    found = produced_by(action, graph)
    return found[0][1] if found else None


def produced_by(action: Action, graph: StageGraph) -> list[tuple[Kind, Transfer]]:
    """Each transfer ``action`` produces, with the send kind that carries it across ranks.

    Read from the table: a send carries the result it needs (``SEND_F`` the
    ``F`` of its stage) to the stage at its ``link``.
    """
    s = action.stage
    spec = kind_spec(action.kind)
    out = []
    for code, sender in KINDS.items():
        if sender.role is not Role.SEND:
            continue
        assert sender.link is not None
        other = graph.neighbour(s, sender.link)
        if any(need.tag in spec.makes for need in sender.needs) and other is not None:
            out.append((Kind(code), _between(s, other, action.microbatch, graph, into=other)))
    return out


def transfer_of(action: Action, graph: StageGraph) -> Transfer:
    """The transfer a communication action (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) moves.

    Raises:
        ValueError: if ``action`` moves nothing (a compute action, or a send
            or receive at the end of the pipeline).
    """
    spec = kind_spec(action.kind)
    s = action.stage
    if spec.link is None:
        raise ValueError(f"{action} is not a transfer")
    other = graph.neighbour(s, spec.link)
    if other is None:
        raise ValueError(f"{action} moves nothing: stage {action.stage} has no such neighbour")
    sends = spec.role is Role.SEND
    return _between(s, other, action.microbatch, graph, into=other if sends else s)


def _between(stage: int, other: int, microbatch: int, graph: StageGraph, into: int) -> Transfer:
    """The transfer between two neighbouring stages, into stage ``into``.

    Towards a later stage it is an activation, towards an earlier one a gradient.
    """
    source = other if into == stage else stage
    direction = Direction.ACTIVATION if into > source else Direction.GRADIENT
    ranks = graph.placement
    return Transfer(direction, min(stage, other), microbatch, ranks[source], ranks[into])


def plan_communication(schedule: Schedule, rank: int) -> CommPlan:
    """The pair orders of every remote transfer that ``rank`` sends or receives.

    Args:
        schedule: a complete schedule (validated by the caller).
        rank: the rank to plan for.

    Returns:
        The rank's plan.

    Raises:
        twobp.schedule.validate.ScheduleError: if the schedule deadlocks.
    """
    produced: list[tuple[int, int, Transfer]] = []
    for step, row in enumerate(dry_run(schedule)):
        for col, action in enumerate(row):
            if action is None or not action.kind.is_compute:
                continue
            transfer = produced_transfer(action, schedule.graph)
            if transfer is not None and not transfer.is_local:
                produced.append((step, col, transfer))
    produced.sort(key=lambda item: (item[0], item[1]))
    peers: dict[int, list[PairOp]] = defaultdict(list)
    for _, _, transfer in produced:
        if transfer.src == rank:
            peers[transfer.dst].append(PairOp(True, transfer))
        elif transfer.dst == rank:
            peers[transfer.src].append(PairOp(False, transfer))
    return CommPlan(rank, {peer: tuple(ops) for peer, ops in sorted(peers.items())})
