"""Which process runs each stage: the map from the schedule's ranks to the group's.

A schedule speaks of *pipeline ranks*: ``placement[s]`` is the pipeline rank
of stage ``s``, and ``actions[r]`` are the actions of pipeline rank ``r``. The
process group speaks of *group ranks*. A :class:`Topology` maps one onto the
other, and says which group ranks hold a replica of each stage. With one
pipeline over the whole group both numberings agree, but no code may rely on
that: the step start, the checks, the gradient norm, the checkpoint files and
the transfers ask the topology.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twobp.runtime.base.group import Membership
from twobp.schedule.schedule import Schedule


@dataclass(frozen=True)
class Topology:
    """Where every stage of a pipeline runs, in a process group.

    Args:
        members: this process's place in the process group.
        stage_ranks: for each stage, the group ranks that hold a replica of
            it, the first being the stage's own pipeline's.
        placement: the pipeline rank of each stage (the schedule's placement).
        pipeline_ranks: for each pipeline rank, the group rank that runs it
            in this process's pipeline.
        dp_rank: which copy of the pipeline this process belongs to.
        dp_size: how many copies of the pipeline run side by side (data parallel).

    Raises:
        ValueError: if the maps disagree with each other or with the group.
    """

    members: Membership
    placement: tuple[int, ...]
    pipeline_ranks: tuple[int, ...]
    stage_ranks: tuple[tuple[int, ...], ...]
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        if len(self.stage_ranks) != len(self.placement):
            raise ValueError(
                f"{len(self.stage_ranks)} stage replica lists for {len(self.placement)} stages"
            )
        if max(self.placement) + 1 != len(self.pipeline_ranks):
            raise ValueError(
                f"the placement {self.placement} needs {max(self.placement) + 1} pipeline ranks, "
                f"got {len(self.pipeline_ranks)}"
            )
        for rank in self.pipeline_ranks:
            if not 0 <= rank < self.members.size:
                raise ValueError(f"group rank {rank} is not in a group of {self.members.size}")

    @classmethod
    def one_pipeline(cls, members: Membership, placement: Sequence[int]) -> Topology:
        """One pipeline over the whole group: pipeline rank ``r`` is group rank ``r``.

        Raises:
            ValueError: if the placement does not use exactly the group's ranks.
        """
        placement = tuple(placement)
        n = max(placement) + 1
        if n != members.size:
            raise ValueError(
                f"the schedule places its stages on {n} ranks but the group has {members.size}"
            )
        return cls(members, placement, tuple(range(n)), tuple((r,) for r in placement))

    @classmethod
    def replicated(
        cls, members: Membership, schedule: Schedule, grid: Sequence[Sequence[int]]
    ) -> Topology:
        """``len(grid)`` copies of the pipeline; copy ``d`` runs rank ``r`` on ``grid[d][r]``.

        A stage's replicas are the ranks that run its model stage in any copy
        and in any of the schedule's pipelines (Chimera has two), copy 0's
        first pipeline first.

        Raises:
            ValueError: if the grid does not cover the group once, or its rows
                do not have one rank per pipeline rank of the schedule.
        """
        rows = tuple(tuple(int(r) for r in row) for row in grid)
        flat = sorted(r for row in rows for r in row)
        if flat != list(range(members.size)):
            raise ValueError(
                f"the data-parallel grid {[list(r) for r in rows]} must hold every rank of the "
                f"group of {members.size} exactly once"
            )
        if any(len(row) != schedule.n_ranks for row in rows):
            raise ValueError(
                f"each copy of the pipeline needs {schedule.n_ranks} ranks, got rows of "
                f"{sorted({len(row) for row in rows})}"
            )
        dp_rank = next(d for d, row in enumerate(rows) if members.rank in row)
        placement = schedule.placement
        stage_ranks = tuple(
            tuple(
                row[placement[replica]]
                for row in rows
                for replica in schedule.replicas_of(schedule.model_stage(s))
            )
            for s in range(schedule.n_stages)
        )
        return cls(members, placement, rows[dp_rank], stage_ranks, dp_rank, len(rows))

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self.members.rank

    @property
    def is_single(self) -> bool:
        """True when this process is the whole world (no communication)."""
        return self.members.is_single

    @property
    def pp_rank(self) -> int:
        """This process's pipeline rank: which rank of the schedule it runs.

        Raises:
            ValueError: if this process runs no pipeline rank.
        """
        return self.pipeline_ranks.index(self.members.rank)

    @property
    def pp_size(self) -> int:
        """Ranks of one pipeline."""
        return len(self.pipeline_ranks)

    def group_rank(self, pipeline_rank: int) -> int:
        """The group rank that runs ``pipeline_rank`` in this process's pipeline."""
        return self.pipeline_ranks[pipeline_rank]

    def rank_of_stage(self, stage: int) -> int:
        """The group rank of ``stage`` in this process's pipeline."""
        return self.group_rank(self.placement[stage])

    def replicas(self, stage: int) -> tuple[int, ...]:
        """The group ranks that hold a replica of ``stage``."""
        return self.stage_ranks[stage]

    @property
    def writes_stage_files(self) -> bool:
        """True if this process writes checkpoint files: those of :attr:`written_stages`."""
        return bool(self.written_stages)

    @property
    def written_stages(self) -> tuple[int, ...]:
        """The stages this process writes to a checkpoint: those it holds the first replica of."""
        return tuple(s for s in self.stages_here if self.replicas(s)[0] == self.rank)

    @property
    def stages_here(self) -> tuple[int, ...]:
        """The stages this process runs."""
        pp = self.pp_rank
        return tuple(s for s, r in enumerate(self.placement) if r == pp)
