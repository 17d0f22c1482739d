"""A whole schedule: the ordered actions of every rank, and where stages live.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from twobp.schedule.action import Action


@dataclass(frozen=True, eq=True)
class Schedule:
    """The ordered list of actions of every rank.

    Args:
        placement: the rank that owns each stage, indexed by stage
            (``placement[s]`` is the rank of stage ``s``).
        n_microbatches: how many micro-batches one step covers.
        actions: for each rank, its actions in execution order.
        name: a label for pictures and reports (e.g. ``"1f1b+2bp:paper"``).

    Raises:
        ValueError: if a rank has no entry, or an action names a stage that
            the rank does not own or a micro-batch out of range.
    """

    placement: tuple[int, ...]
    n_microbatches: int
    actions: Mapping[int, tuple[Action, ...]] = field(hash=False)
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", tuple(self.placement))
        frozen = {int(r): tuple(a) for r, a in sorted(self.actions.items())}
        object.__setattr__(self, "actions", frozen)
        if not self.placement:
            raise ValueError("a schedule needs at least one stage")
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {self.n_microbatches}")
        ranks = sorted(set(self.placement))
        if ranks != list(range(len(ranks))):
            raise ValueError(f"placement {self.placement} must use ranks 0..n-1 without gaps")
        missing = [r for r in ranks if r not in frozen]
        if missing:
            raise ValueError(f"schedule has no action list for rank(s) {missing}")
        for rank, acts in frozen.items():
            for a in acts:
                if a.stage >= len(self.placement) or self.placement[a.stage] != rank:
                    raise ValueError(
                        f"rank {rank} lists {a}, but stage {a.stage} is not on rank {rank} "
                        f"(placement {self.placement})"
                    )
                if max(a.microbatches) >= self.n_microbatches:
                    raise ValueError(
                        f"rank {rank} lists {a}, but the schedule has only "
                        f"{self.n_microbatches} micro-batches"
                    )

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.placement)

    @property
    def n_ranks(self) -> int:
        """Number of ranks."""
        return max(self.placement) + 1

    def rank_of(self, stage: int) -> int:
        """The rank that owns ``stage``."""
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages owned by ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def with_actions(
        self, actions: Mapping[int, Sequence[Action]], name: str | None = None
    ) -> Schedule:
        """A copy with other actions (and optionally another name)."""
        return Schedule(
            self.placement,
            self.n_microbatches,
            {r: tuple(a) for r, a in actions.items()},
            self.name if name is None else name,
        )

    def __str__(self) -> str:
        lines = [
            f"{self.name or 'schedule'}: {self.n_ranks} ranks, {self.n_stages} stages, "
            f"{self.n_microbatches} micro-batches"
        ]
        for rank, acts in self.actions.items():
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)
