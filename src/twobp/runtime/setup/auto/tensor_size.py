"""``schedule="auto"`` over a range of tensor-parallel sizes: which ``T`` runs.

``Pipeline(schedule="auto", tensor_parallel=(1, 2, 4), tensor_parallel_plan=PLAN)``
decides ``T`` before any tensor-parallel group exists (the groups are made for the size
chosen). On ``N`` ranks with ``D`` copies, each size of the range that divides ``N / D``
and the widths, vocabularies and heads the plan splits is a candidate with
``P = N / (D x T)`` pipeline ranks. Rank 0 profiles the whole model once, unsplit, on the
example micro-batch, and all ranks measure the machine (contention, the link between
pipeline ranks, an all-reduce's latency and bandwidth:
:mod:`twobp.runtime.setup.auto.cost_measurement`);
with ``costs=`` nothing is measured and the choice is the same on any machine. Each
size's cost model is that one with the plan's split
(:func:`twobp.sim.tensor_parallel.tensor_parallel_costs`: the split modules' compute and
weights over ``T``, their all-reduces and gathers timed on the measured all-reduce, or on
the cost model's ``reduce_bandwidth`` and ``send_latency``); rank 0 searches every
schedule, 2BP policy and stage count at each ``P`` as ``schedule="auto"`` does, takes
the size whose fastest candidate within ``memory_limit`` simulates fastest (of equal ones
the smaller) and sends that plan to every rank. Each rank then makes its groups at that
size and runs the plan as it is (no trial steps).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from twobp.models.tensor_parallel import Chosen, check_divides, planned_modules
from twobp.runtime.base.group import Membership
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.options import Batch, PipelineOptions
from twobp.runtime.setup.auto.cost_measurement import Measured, allreduce_link, measure
from twobp.runtime.setup.auto.plan import (
    AutoPlan,
    OptimizerMemory,
    OptionSpace,
    SizeTried,
    choose_plan,
    costs_of,
    profiling_input,
)
from twobp.runtime.setup.data_parallel import data_parallel_grid
from twobp.runtime.setup.decide import decided_on_rank_0
from twobp.runtime.setup.given_blocks import as_blocks
from twobp.runtime.setup.pipeline_plan import auto_arguments, searched_policies
from twobp.runtime.setup.replicas import tied_across_blocks
from twobp.runtime.setup.tensor_parallel import block_plans
from twobp.schedule.prepare import DEFAULT_MICROBATCHES
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor
from twobp.sim.recompute import NO_RECOMPUTE
from twobp.sim.search import auto_options
from twobp.sim.tensor_parallel import BlockSplit, Link, tensor_parallel_costs

COLLECTIVE_BYTES = 4 * 2**20
"""Bytes of the all-reduce the collectives' speed is measured on."""
FORWARD_REDUCES = ("rowwise", "embedding_rowwise")
"""Styles that all-reduce their output in ``F``."""
INPUT_REDUCES = ("colwise", "colwise_gather_output", "colwise_loss_parallel")
"""Styles that all-reduce their input gradient in ``I``."""

log = logging.getLogger("twobp")


def decide_size(
    blocks: object,
    options: PipelineOptions,
    world: Membership,
    device: torch.device,
    example_input: Batch | None,
) -> tuple[PipelineOptions, AutoPlan]:
    """The size of ``options.tensor_parallel``'s range that runs, and its plan. Collective
    over the world: every rank calls it, before any tensor-parallel group is made.

    Args:
        blocks: the whole model's blocks (as :class:`twobp.runtime.Pipeline` takes them).
        options: the pipeline's options, ``tensor_parallel`` a range of sizes.
        world: every rank.
        device: where rank 0 profiles.
        example_input: one micro-batch of inputs (unless ``options.costs``).

    Returns:
        The options at the size chosen (``tensor_parallel`` that size, None for 1), and the
        plan every rank runs (:attr:`AutoPlan.tensor_sizes` says what each size simulated).

    Raises:
        PipelineConfigError: on every rank: no size of the range divides the ranks or the
            plan's modules, nothing fits ``memory_limit``, or what ``schedule="auto"``
            refuses.
    """
    assert not isinstance(options.tensor_parallel, int | None), "a range of sizes"
    sizes = tuple(options.tensor_parallel)
    given = f"tensor_parallel={sizes!r}"
    timeout = float(options.timeout)
    limit, model = auto_arguments(
        world,
        device,
        timeout,
        options.memory_limit,
        options.costs,
        example_input,
        options.auto_trials,
    )
    model_blocks = as_blocks(blocks)
    copies = options.data_parallel or 1
    if world.size % copies:
        raise PipelineConfigError(
            f"{given}: {world.size} ranks do not form data_parallel={copies} copies; start a "
            f"multiple of {copies} processes"
        )
    per_copy = world.size // copies
    splits, tried = _candidates(model_blocks, options, sizes, per_copy)
    if not any(not t.why_not for t in tried):
        raise PipelineConfigError(
            f"{given}: no size can run: {'; '.join(str(t) for t in tried)}; give sizes that "
            f"divide the {per_copy} ranks of a copy and the plan's widths and heads"
        )
    measured: Measured | None = None
    count = options.n_microbatches
    m = count if isinstance(count, int) else DEFAULT_MICROBATCHES  # 'auto' was refused
    if model is None:
        ranks = data_parallel_grid(world, copies, None)[0]  # one copy at T = 1
        example = profiling_input(example_input)
        measured = measure(model_blocks, world, device, example, m, ranks)
        link = Link(*reversed(allreduce_link(world, device, COLLECTIVE_BYTES)))
    else:
        link = Link(model.reduce_bandwidth or model.bandwidth, model.send_latency)

    def choose() -> AutoPlan:
        space = _space(model_blocks, options, model, measured, m)
        return _fastest(space, splits, tried, link, (limit, copies, model_blocks))

    plan = decided_on_rank_0(world, choose, AutoPlan, lambda exc: f"{given}: {exc}")
    if world.rank == 0:
        log.info("%s", plan.summary())
    size = plan.tensor_parallel
    return replace(options, tensor_parallel=size if size > 1 else None), plan


def block_splits(blocks: Sequence[nn.Module], chosen: Sequence[Chosen]) -> list[BlockSplit]:
    """What the plan splits of each block: the split modules' share of its parameters,
    and its collectives (:class:`twobp.sim.tensor_parallel.BlockSplit`). Column-parallel
    linears of one parent module (``attn.wq``, ``attn.wk``, ``attn.wv``) are taken to
    read one input, whose gradient they all-reduce once, as the runtime does."""
    out = []
    for block, modules in zip(blocks, chosen, strict=True):
        total = sum(p.numel() for p in block.parameters())
        split = {id(p): p.numel() for m, _ in modules.values() for p in m.parameters()}
        styles = [style for _, style in modules.values()]
        inputs = {name.rpartition(".")[0] for name, (_, s) in modules.items() if s in INPUT_REDUCES}
        out.append(
            BlockSplit(
                share=sum(split.values()) / total if total else 0.0,
                forward_reduces=sum(s in FORWARD_REDUCES for s in styles),
                forward_gathers=styles.count("colwise_gather_output"),
                input_reduces=len(inputs),
            )
        )
    return out


def _candidates(
    blocks: Sequence[nn.Module], options: PipelineOptions, sizes: Sequence[int], per_copy: int
) -> tuple[list[BlockSplit], list[SizeTried]]:
    """What the plan splits of each block, and each size, with why it cannot run ("" if
    it can). The same on every rank."""
    plan = options.tensor_parallel_plan
    chosen: list[Chosen] = [{} for _ in blocks]
    if plan is not None:
        try:
            chosen = planned_modules(blocks, block_plans(blocks, plan))
        except ValueError as exc:
            raise PipelineConfigError(str(exc)) from None
    tried = []
    for size in sizes:
        why_not = ""
        if per_copy % size:
            why_not = f"does not divide the {per_copy} ranks of a copy"
        else:
            try:
                check_divides(blocks, chosen, size)
            except ValueError as exc:
                why_not = str(exc)
        tried.append(SizeTried(size, per_copy // size if not why_not else 0, None, why_not))
    return block_splits(blocks, chosen), tried


def _space(
    blocks: Sequence[nn.Module],
    options: PipelineOptions,
    model: CostModel | None,
    measured: Measured | None,
    m: int,
) -> OptionSpace:
    """The options ``schedule="auto"`` searches, with the unsplit model's costs."""
    two_bp = options.two_bp
    choices = auto_options(
        m,
        two_bp=two_bp is not False,
        schedules=None,
        policies=searched_policies(options.two_bp_policy, two_bp, False),
        stages_per_rank=options.stages_per_rank,
        recompute=NO_RECOMPUTE,
    )
    sizes_for, costs_for = costs_of(blocks, options.partition, model, measured)
    sharded = options.shard_parameters
    optimizer = OptimizerMemory(
        options.optimizer_state_bytes, options.optimizer_sharded or sharded, sharded
    )
    costs_for = optimizer.counted(costs_for, sizes_for, blocks)
    return OptionSpace(None, m, choices, costs_for, sizes_for)


def _fastest(
    space: OptionSpace,
    splits: Sequence[BlockSplit],
    tried: Sequence[SizeTried],
    link: Link,
    fixed: tuple[float | None, int, Sequence[nn.Module]],
) -> AutoPlan:
    """Rank 0's search at every size that can run: the plan of the fastest."""
    limit, copies, blocks = fixed
    plans: dict[int, AutoPlan] = {}
    out = []
    for t in tried:
        if t.why_not:
            out.append(t)
            continue
        at_size = replace(space, costs_for=_split_costs(space, splits, t.size, link))
        try:
            plan = choose_plan([at_size], t.pipeline, limit, copies, 1, tied_across_blocks(blocks))
        except (PipelineConfigError, ValueError) as exc:
            out.append(replace(t, why_not=str(exc)))
            continue
        plans[t.size] = plan
        out.append(replace(t, step=plan.predicted_step_time))
    if not plans:
        raise PipelineConfigError(f"no size can run: {'; '.join(str(t) for t in out)}")
    best = min(plans, key=lambda s: (plans[s].predicted_step_time, s))
    return replace(plans[best], tensor_sizes=tuple(out), tensor_parallel=best)


def _split_costs(
    space: OptionSpace, splits: Sequence[BlockSplit], size: int, link: Link
) -> CostsFor:
    """The cost model of any number of stages, each split over ``size`` ranks."""

    def costs(n_stages: int) -> CostModel:
        model, sizes = space.costs_for(n_stages), space.sizes_for(n_stages)
        return tensor_parallel_costs(model, splits, sizes, size, link, _entering(model, sizes))

    return costs


def _entering(model: CostModel, sizes: Sequence[int]) -> list[float]:
    """Per block, the bytes of the hidden state entering it: what the stage before sends
    (the first stage's blocks: what it sends itself)."""
    sent = model.send_bytes
    assert sent is not None  # filled in by CostModel
    return [sent[max(s - 1, 0)] for s, n in enumerate(sizes) for _ in range(n)]
