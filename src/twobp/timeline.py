"""Timelines: start and end times of actions, simulated or measured.

The simulator produces them from a cost model, the runtime records them from a
real run; the renderers and the bubble figures read only this type. This
module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from twobp.schedule.action import Action
from twobp.schedule.kinds import ActionKind, Role, kind_spec


@dataclass(frozen=True)
class Span:
    """One action as it ran (or would run) on one rank.

    Args:
        rank: the rank that ran it.
        action: what ran.
        start: start time in seconds (any common origin).
        end: end time in seconds, ``>= start``.
    """

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


def busy_time(spans: Iterable[Span], rank: int) -> float:
    """Total compute time (F, B, I, W: the kinds whose role is compute) of ``rank``;
    communication and background work (R) do not count."""
    return sum(s.duration for s in spans if s.rank == rank and s.action.kind.role is Role.COMPUTE)


def makespan(spans: Sequence[Span]) -> float:
    """Time from the earliest start to the latest end over all ranks (0 if empty)."""
    if not spans:
        return 0.0
    return max(s.end for s in spans) - min(s.start for s in spans)


def bubble_ratio(spans: Sequence[Span], rank: int | None = None) -> float:
    """Idle fraction of the makespan: of one rank, or averaged over all ranks.

    Idle time is the makespan minus the rank's compute time, so time spent
    waiting on communication counts as bubble.
    """
    total = makespan(spans)
    if total <= 0:
        return 0.0
    ranks = sorted({s.rank for s in spans}) if rank is None else [rank]
    idle = [total - busy_time(spans, r) for r in ranks]
    return sum(idle) / (len(ranks) * total)


def kind_label(kind: ActionKind) -> str:
    """A short human name of an action kind, for legends (from the kind table)."""
    return kind_spec(kind).label
