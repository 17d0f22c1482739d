"""``two_bp=None`` (the default) with an example input: 2BP on the stages where it pays.

Rank 0 profiles the blocks as ``schedule="auto"`` does (F with and without the
2BP engine, I, W, the fused B, W over several micro-batches; then all ranks
measure their contention and the link: :mod:`twobp.runtime.setup.auto.cost_measurement`),
builds the cost model of the pipeline's partition and simulates the schedule
with every set of split stages (:func:`twobp.sim.split_choice.choose_split`).
Every rank runs rank 0's choice. Collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from twobp.runtime.base.group import Membership
from twobp.runtime.execution.microbatch import Batch
from twobp.runtime.setup.auto.cost_measurement import Measured, measure
from twobp.runtime.setup.auto.plan import measured_costs
from twobp.runtime.setup.decide import decided_on_rank_0
from twobp.schedule import Schedule
from twobp.sim.candidate import fit_costs
from twobp.sim.from_profile import CostsFor
from twobp.sim.split_choice import SplitChoice, choose_split

log = logging.getLogger("twobp")


def choose_two_bp(
    blocks: Sequence[nn.Module],
    world: Membership,
    device: torch.device,
    schedule: Schedule,
    counts: Sequence[int],
    example_input: Batch,
    *,
    policy: str,
    pipeline_ranks: Sequence[int],
    reduce: bool,
    data_parallel: int,
    measured: Measured | None = None,
) -> SplitChoice:
    """Which stages of the model split their backward, the same on every rank.

    Args:
        blocks: the whole model's blocks.
        world: the group.
        device: where rank 0 profiles the blocks.
        schedule: the sourced compute-only schedule.
        counts: blocks per stage of the model.
        example_input: one micro-batch of model inputs.
        policy: the 2BP policy of the split stages.
        pipeline_ranks: the group ranks of the first copy of the pipeline.
        reduce: the schedule's stages reduce their gradients (``R``).
        data_parallel: copies of the pipeline.
        measured: the blocks, the contention and the link, measured on
            ``example_input`` already (:func:`~twobp.runtime.setup.auto.cost_measurement.measure`);
            None: measured here.

    Returns:
        Rank 0's choice.

    Raises:
        PipelineConfigError: on every rank, if profiling or simulating failed on rank 0.
    """
    if measured is None:
        measured = measure(
            blocks, world, device, example_input, schedule.n_microbatches, pipeline_ranks
        )

    def choose() -> SplitChoice:
        chosen = choose_split(
            schedule,
            fit_costs(stage_costs(measured, counts), schedule),
            policy=policy,
            reduce=reduce,
            data_parallel=data_parallel,
        )
        log.info("two_bp: %s", chosen.summary())
        return chosen

    return decided_on_rank_0(
        world,
        choose,
        SplitChoice,
        lambda exc: (
            f"two_bp=None chooses the stages 2BP pays on by a profile, which failed: {exc}; "
            "pass two_bp=True or False to run without the profile"
        ),
    )


def stage_costs(measured: Measured, counts: Sequence[int]) -> CostsFor:
    """The cost model of the blocks cut into stages of ``counts`` blocks, from rank 0's
    measurements (weights and their gradients counted as :data:`PARAMETER_FACTOR`).

    Raises:
        PipelineConfigError: if profiling failed on rank 0.
    """
    sizes = tuple(counts)
    return measured_costs(measured, lambda _n: sizes)
