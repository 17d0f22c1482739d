"""``shard_parameters=True``: this rank's parameters sharded over the stage's holders (ZeRO-3).

Built with the rank's parts (:func:`twobp.runtime.setup.build_rank.build_rank`):
every bucket of a stage's parameters becomes one padded flat buffer cut into
one shard per rank that holds the stage: its data-parallel copies, and under
Chimera and DualPipe the two ranks of each copy whose pipelines run it (the
stage's reduction group, one process group per stage of the model even where
two have the same ranks; the layout of ``Pipeline.shard_optimizer``,
:mod:`twobp.runtime.state.sharded_optimizer`); each rank keeps its shard as
a tensor of its own and the flat buffers hold nothing between steps. Within a
step (:mod:`twobp.runtime.execution.residency`):

* the gathers of every stage's buckets start before the step's first action,
  in the order of the stages' first ``F``; each block waits for its own
  before its forward runs (the buckets of one group are gathered in their
  one order on every holder; those of different groups need not pair up);
* a stage's buckets are freed right after its last ``I`` (or ``B``) of the
  step, before its deferred ``W`` run: ``W`` reads only what ``I`` stashed;
* the stage's ``R``, right after its last ``W``, reduce-scatters its
  gradients: each rank keeps the sum of its shard only.

twobp's own all-gather and reduce-scatter do this rather than torch's FSDP2
(``fully_shard``): FSDP2 reduce-scatters in a post-backward hook that fires
when autograd's backward of a module ends, which under 2BP is the end of
``I``, before ``W`` has produced any weight gradient.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from twobp.runtime.communication.reduction import GradientReducer
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import PipelineOptions
from twobp.runtime.state.sharded_optimizer import ShardedParameters, make_shards
from twobp.schedule.schedule import Schedule


def check_shardable(
    options: PipelineOptions,
    schedule: Schedule,
    dp_size: int,
    rank: int,
) -> None:
    """Refuse ``shard_parameters=True`` where its shards could not be laid out.

    Raises:
        PipelineConfigError: naming what stands in the way and what to do.
    """
    where = f"rank {rank}: shard_parameters=True"
    alone = [k for k in range(schedule.pipeline_stages) if dp_size * holders(schedule, k) < 2]
    if alone:
        raise PipelineConfigError(
            f"{where} shards each stage over the ranks that hold it, and stage {alone[0]} "
            "of the model is held by one: give data_parallel=2 or more, or leave "
            "shard_parameters out"
        )


def holders(schedule: Schedule, model_stage: int) -> int:
    """How many ranks of one copy of the pipeline hold ``model_stage`` (two in Chimera's
    and DualPipe's two pipelines, one rank holding the first stage of one and the last of
    the other)."""
    return len({schedule.placement[s] for s in schedule.replicas_of(model_stage)})


def shard_parameters(
    reducer: GradientReducer | None,
    schedule: Schedule,
    pp_rank: int,
    stage_modules: Mapping[int, nn.Module],
    names: Mapping[int, str],
    rank: int,
    timeout: float,
) -> ShardedParameters:
    """This rank's parameters sharded over their copies; their flat buffers freed now.

    Raises:
        PipelineConfigError: if no parameter here is held by another copy.
    """
    if reducer is None or not any(b.parameters for bs in reducer.by_stage.values() for b in bs):
        raise PipelineConfigError(
            f"rank {rank}: shard_parameters=True found no parameter here held by another "
            "copy: give data_parallel=2 or more"
        )
    return make_shards(
        reducer, schedule, pp_rank, stage_modules, names, rank, timeout, resident=False
    )


def refuse_full_parameters(options: PipelineOptions, rank: int) -> None:
    """Refuse ``pipe.parameters()`` under ``shard_parameters=True``: an optimizer over the
    full parameters would step tensors that hold nothing between steps, and no gradient.

    Raises:
        PipelineConfigError: saying to build the optimizer with ``pipe.shard_optimizer``.
    """
    if options.shard_parameters:
        raise PipelineConfigError(
            f"rank {rank}: with shard_parameters=True the parameters are sharded and hold "
            "their values only inside a step: build the optimizer with "
            "pipe.shard_optimizer(torch.optim.AdamW, lr=...), and read the whole parameters "
            "with pipe.state_dict()"
        )
