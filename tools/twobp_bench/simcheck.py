"""The simulator check: predicted step time of a twobp variant from profiled costs.

For a schedule and its partition, each stage's costs are the sums of its
blocks' costs as measured by the rank that runs the stage; W over ``k``
micro-batches reads the measured concatenation table; a transfer between
ranks takes the measured latency plus its bytes over the measured bandwidth.
The blocks were profiled on all ranks at once, so their times are divided by
the measured contention (how much slower the ranks compute together than
alone) and the simulator gets that contention: an action that overlaps work
on the other rank runs slower than one that has the machine to itself. Each
transfer to another rank also holds its sender for the measured time of a
send (gloo copies the message in the caller, while the peer computes).
:func:`twobp.sim.simulate` then gives the makespan, which is compared with
the measured step time. This module imports no torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol

from twobp.partition.solver import stage_ranges
from twobp.schedule import Action, Schedule
from twobp.sim import CostModel, SimResult, simulate
from twobp.sim.from_profile import BlockFigures, stage_cost_model
from twobp.sim.reduction import with_reductions


class ProfileLike(Protocol):
    """One rank's profile (a :class:`~twobp_bench.profile.RankProfile`)."""

    @property
    def blocks(self) -> Sequence[BlockFigures]: ...

    @property
    def weight_concat(self) -> Sequence[Mapping[int, float]]: ...

    @property
    def link_latency(self) -> float: ...

    @property
    def link_bandwidth(self) -> float: ...

    @property
    def contention(self) -> float: ...

    @property
    def reduce_bandwidth(self) -> float: ...


def stage_costs(
    profiles: Sequence[ProfileLike],
    partition: Sequence[int],
    stage_ranks: Sequence[int],
    send_overhead: float = 0.0,
) -> CostModel:
    """The cost model of a partition, each stage costed by the rank that runs it.

    Args:
        profiles: the profile of every rank, indexed by rank.
        partition: blocks per stage.
        stage_ranks: the rank of each stage.
        send_overhead: the sender's time per transfer to another rank.

    Returns:
        The per-stage cost model of :func:`twobp.sim.from_profile.stage_cost_model`,
        with W tables, the link and all-reduce bandwidth of rank 0's profile,
        the ranks' mean contention, and times divided by it (alone times).

    With several pipelines over the same stages of the model (Chimera: the
    placement lists ``k`` times as many stages as the partition), each
    stage of the model is costed by its rank in the first pipeline, and the
    model is repeated for the others.

    Raises:
        ValueError: if the partition and the placement disagree on the stage count.
    """
    copies = len(stage_ranks) // len(partition) if len(partition) else 0
    if copies > 1 and len(stage_ranks) == copies * len(partition):
        first = stage_costs(profiles, partition, stage_ranks[: len(partition)], send_overhead)
        return first.tile(copies)
    if len(partition) != len(stage_ranks):
        raise ValueError(
            f"partition has {len(partition)} stages but the placement {tuple(stage_ranks)} "
            f"has {len(stage_ranks)}"
        )
    # Each block's figures from the profile of the rank that runs its stage.
    ranges = zip(stage_ranks, stage_ranges(partition), strict=True)
    owners = [profiles[rank] for rank, r in ranges for _ in r]
    link = profiles[0]
    return stage_cost_model(
        [owner.blocks[i] for i, owner in enumerate(owners)],
        partition,
        weight_concat=[owner.weight_concat[i] for i, owner in enumerate(owners)],
        contention=statistics.fmean(p.contention for p in profiles),
        send_latency=link.link_latency,
        bandwidth=link.link_bandwidth,
        send_overhead=send_overhead,
        reduce_bandwidth=None if math.isinf(link.reduce_bandwidth) else link.reduce_bandwidth,
    )


def simulated_step(
    schedule: Schedule,
    profiles: Sequence[ProfileLike],
    partition: Sequence[int],
    send_overhead: float = 0.0,
    data_parallel: int = 1,
) -> SimResult:
    """The simulation of ``schedule`` under the profiled costs.

    Its ``makespan`` is the predicted step time; its ``busy`` the predicted
    compute time of each rank, which tells a cost error (busy times disagree)
    from a schedule or communication error (they agree, the makespan does not).

    Where the schedule reduces replicated stages (its ``R`` actions: Chimera,
    or ``data_parallel`` copies), each reduction takes the time of a ring
    all-reduce of the stage's parameter bytes over its ``data_parallel x
    n_pipelines`` replicas at the measured link, as the planner counts it.
    """
    costs = stage_costs(profiles, partition, schedule.placement, send_overhead)
    # The schedule ran with its R actions: only their time is added.
    return simulate(schedule, with_reductions(schedule, costs, data_parallel)[1])


def replayed_step(
    run_actions: Mapping[int, Sequence[str]],
    placement: Sequence[int],
    n_microbatches: int,
    action_seconds: Mapping[str, Sequence[float]],
    link: tuple[float, float],
    send_bytes: Sequence[float] | None = None,
    n_pipelines: int = 1,
    send_overhead: float = 0.0,
    reduce: Sequence[float] | None = None,
) -> SimResult:
    """The simulation of the actions as they ran, with their measured mean times.

    A step's length is a sum of its actions', so it follows their means: a
    median leaves out the slow tail (an action that another process
    interrupted), which every measured step pays its share of.

    Args:
        run_actions: each rank's actions (text form) in the order they ran.
        placement: the rank of each stage.
        n_microbatches: micro-batches of the step.
        action_seconds: measured durations by ``"stage:kind:micro-batches"`` (every
            occurrence, over micro-batches and rounds).
        link: ``(latency, bandwidth)`` of a transfer between ranks.
        send_bytes: bytes crossing each stage boundary (None: latency only).
        n_pipelines: the pipelines the stages form (2 for Chimera).
        send_overhead: the sender's time per transfer to another rank.
        reduce: per stage, the time of its gradient all-reduce (an ``R`` runs it
            in the background; None: free). Its measured span is only its start.

    Returns:
        The simulation.
    """
    n_stages = len(placement)

    def mean(stage: int, kind: str, count: int = 1) -> float:
        times = action_seconds.get(f"{stage}:{kind}:{count}")
        return statistics.fmean(times) if times else 0.0

    tables = []
    for stage in range(n_stages):
        counts = sorted(
            int(key.split(":")[2]) for key in action_seconds if key.startswith(f"{stage}:W:")
        )
        tables.append({k: mean(stage, "W", k) for k in counts} or None)
    model = CostModel(
        forward=tuple(mean(s, "F") for s in range(n_stages)),
        backward_input=tuple(mean(s, "I") for s in range(n_stages)),
        backward_weight=tuple(mean(s, "W") for s in range(n_stages)),
        backward_full=tuple(mean(s, "B") for s in range(n_stages)),
        weight_concat=tuple(tables),
        send_latency=link[0],
        bandwidth=link[1],
        send_bytes=None if send_bytes is None else tuple(send_bytes),
        send_overhead=send_overhead,
        reduce=None if reduce is None else tuple(reduce),
    )
    schedule = Schedule(
        tuple(placement),
        n_microbatches,
        {rank: tuple(Action.parse(a) for a in acts) for rank, acts in run_actions.items()},
        name="as run",
        n_pipelines=n_pipelines,
    )
    return simulate(schedule, model)
