"""A whole schedule: the ordered actions of every rank, and where stages live.

:class:`StageGraph` is the part of a schedule that says which stage follows
which: the stages' ranks and the pipelines they form, kept together.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

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
        n_pipelines: how many pipelines the stages form (2 for Chimera). The
            stages are numbered pipeline after pipeline: with ``S`` stages per
            pipeline, stage ``s`` is stage ``s % S`` of the model in pipeline
            ``s // S``, and the stages ``k``, ``S + k``, ... are replicas of
            one another (one set of weights, their gradients reduced). Each
            pipeline runs its own share of the micro-batches: pipeline ``k``
            the ``k``-th of ``n_pipelines`` equal, consecutive parts.

    Raises:
        ValueError: if a rank has no entry, an action names a stage that the
            rank does not own or a micro-batch out of range (or of another
            pipeline), or the stages or micro-batches do not divide among
            the pipelines.
    """

    placement: tuple[int, ...]
    n_microbatches: int
    actions: Mapping[int, tuple[Action, ...]] = field(hash=False)
    name: str = ""
    n_pipelines: int = 1

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
        if self.n_pipelines < 1 or len(self.placement) % self.n_pipelines:
            raise ValueError(
                f"{len(self.placement)} stages do not form {self.n_pipelines} pipelines of equal "
                "length"
            )
        if self.n_microbatches % self.n_pipelines:
            raise ValueError(
                f"{self.n_microbatches} micro-batches do not divide among {self.n_pipelines} "
                "pipelines: use a multiple of the number of pipelines"
            )
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
                own = self.microbatches_of(a.stage)
                if a.microbatches[0] < own.start or a.microbatches[-1] >= own.stop:
                    raise ValueError(
                        f"rank {rank} lists {a}, but stage {a.stage} is in pipeline "
                        f"{self.pipeline_of(a.stage)}, which runs micro-batches "
                        f"{own.start}..{own.stop - 1}"
                    )

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.placement)

    @property
    def n_ranks(self) -> int:
        """Number of ranks."""
        return max(self.placement) + 1

    @property
    def pipeline_stages(self) -> int:
        """Stages of one pipeline: the number of stages the model is cut into."""
        return len(self.placement) // self.n_pipelines

    @property
    def is_v_shaped(self) -> bool:
        """True if one pipeline places several stages per rank in a V (``zb-v``,
        ``dualpipev``): the stages run down the ranks and back up, so that two
        consecutive stages share the rank at the turn and rank 0 holds the first
        stage and the last. Such a placement puts the model's two ends (an
        embedding and a head: often its lightest blocks) on one rank, which a
        uniform partition leaves underloaded."""
        stages = self.placement[: self.pipeline_stages]
        return (
            self.n_pipelines == 1
            and len(stages) > self.n_ranks
            and any(a == b for a, b in pairwise(stages))
        )

    @property
    def ends_share_a_rank(self) -> bool:
        """True for a V (:attr:`is_v_shaped`), and where a rank holds the model's first
        stage and its last but not every stage: two pipelines in opposite directions on
        more than two ranks (Chimera, DualPipe: rank 0 holds the first stage of one and the
        last of the other). A uniform partition then loads that rank with both of the
        model's ends (an embedding, a head) against its neighbours' layers."""
        if self.is_v_shaped:
            return True
        last = self.pipeline_stages - 1
        held: dict[int, set[int]] = {}
        for stage, rank in enumerate(self.placement):
            held.setdefault(rank, set()).add(self.model_stage(stage))
        return last > 0 and any(
            {0, last} <= stages and len(stages) <= last for stages in held.values()
        )

    def model_stage(self, stage: int) -> int:
        """Which stage of the model ``stage`` runs (itself, with one pipeline)."""
        return stage % self.pipeline_stages

    def pipeline_of(self, stage: int) -> int:
        """The pipeline ``stage`` belongs to."""
        return stage // self.pipeline_stages

    @property
    def graph(self) -> StageGraph:
        """Which stage follows which: the placement with the pipelines it forms."""
        return StageGraph(self.placement, self.n_pipelines)

    def neighbour(self, stage: int, offset: int) -> int | None:
        """The stage ``offset`` places after ``stage`` in its pipeline, or None past its ends."""
        return self.graph.neighbour(stage, offset)

    def microbatches_of(self, stage: int) -> range:
        """The micro-batches that ``stage``'s pipeline runs."""
        share = self.n_microbatches // self.n_pipelines
        first = self.pipeline_of(stage) * share
        return range(first, first + share)

    def replicas_of(self, model_stage: int) -> tuple[int, ...]:
        """The stages that run ``model_stage`` of the model, one per pipeline."""
        return tuple(k * self.pipeline_stages + model_stage for k in range(self.n_pipelines))

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
            self.n_pipelines,
        )

    def __str__(self) -> str:
        lines = [
            f"{self.name or 'schedule'}: {self.n_ranks} ranks, {self.n_stages} stages, "
            f"{self.n_microbatches} micro-batches"
            + (f", {self.n_pipelines} pipelines" if self.n_pipelines > 1 else "")
        ]
        for rank, acts in self.actions.items():
            lines.append(f"  rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


@dataclass(frozen=True)
class StageGraph:
    """Which stage follows which: the rank of each stage and the pipelines the stages form.

    The two go together: with the placement alone, the last stage of
    Chimera's first pipeline would seem to feed the first of its second.

    Args:
        placement: the rank of each stage (``placement[s]`` is the rank of stage ``s``).
        n_pipelines: how many pipelines the stages form (see :class:`Schedule`).
    """

    placement: tuple[int, ...]
    n_pipelines: int

    @property
    def n_stages(self) -> int:
        """Stages of the whole schedule."""
        return len(self.placement)

    def neighbour(self, stage: int, offset: int) -> int | None:
        """The stage ``offset`` after ``stage`` in the same pipeline, or None past its ends.

        Args:
            stage: a stage.
            offset: how many stages later (negative: earlier).
        """
        n_stages = len(self.placement)
        length = n_stages // self.n_pipelines
        other = stage + offset
        if not 0 <= other < n_stages or other // length != stage // length:
            return None
        return other
