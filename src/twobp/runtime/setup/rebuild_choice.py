"""``recompute="auto"`` on a schedule by name: rebuild stashes only if the default does not fit.

The pipeline first settles what it would run without ``recompute="auto"``
(the schedule, its 2BP stages, its partition); then rank 0 costs it, on the
blocks measured as ``two_bp=None`` measures them
(:func:`twobp.runtime.setup.auto.cost_measurement.measure`) or on ``costs=``, counts
the optimizer state, and keeps it whole if its predicted peak fits
``memory_limit``, else rebuilds the fewest stashes that fit or, where
``two_bp=None`` chose the split stages, splits fewer if that fits and is
predicted faster (:func:`twobp.sim.rebuild_choice.rebuild_to_fit`). Every
rank runs rank 0's choice. Collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from torch import nn

from twobp.runtime.base.group import Membership
from twobp.runtime.setup.auto.cost_measurement import Measured
from twobp.runtime.setup.auto.plan import OptimizerMemory
from twobp.runtime.setup.decide import decided_on_rank_0
from twobp.runtime.setup.two_bp_choice import stage_costs
from twobp.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor
from twobp.sim.rebuild_choice import RebuildChoice, rebuild_to_fit

log = logging.getLogger("twobp")


def choose_rebuilds(
    blocks: Sequence[nn.Module],
    world: Membership,
    schedule: Schedule,
    counts: Sequence[int],
    memory_limit: float,
    *,
    costs: CostModel | Measured,
    optimizer: OptimizerMemory | None,
    data_parallel: int,
    fewer_split: Iterable[Schedule] = (),
) -> RebuildChoice:
    """The schedule to run under ``memory_limit``, the same on every rank.

    Args:
        blocks: the whole model's blocks.
        world: the group.
        schedule: the prepared schedule the pipeline runs without ``recompute="auto"``.
        counts: blocks per stage of the model.
        memory_limit: bytes per rank (or the unit of a given cost model).
        costs: the cost model of the model's stages (``costs=``), or rank 0's
            measurements of the blocks.
        optimizer: the optimizer state to count, and whether it will be sharded.
        data_parallel: copies of the pipeline.
        fewer_split: with ``two_bp=None``, ``schedule`` with fewer of the
            stages it chose split, to run instead if it does not fit (read on
            rank 0 only, and only then).

    Returns:
        Rank 0's choice: ``schedule`` unchanged where it fits.

    Raises:
        PipelineConfigError: on every rank, if rank 0 found that no choice of
            rebuilt stashes fits (naming the rank and what it needs), or
            could not cost the schedule.
    """

    def choose() -> RebuildChoice:
        sizes = tuple(counts)
        costs_for: CostsFor = (
            costs.for_stages if isinstance(costs, CostModel) else stage_costs(costs, counts)
        )
        if optimizer is not None:
            costs_for = optimizer.counted(costs_for, lambda _n: sizes, blocks)
        chosen = rebuild_to_fit(schedule, costs_for, memory_limit, data_parallel, fewer_split)
        log.info("%s", chosen.summary())
        return chosen

    return decided_on_rank_0(world, choose, RebuildChoice, lambda exc: f"recompute='auto': {exc}")
