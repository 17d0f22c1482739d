"""Every layout of a decoder on ``n`` devices, simulated on analytic costs.

A layout is ``P`` pipeline ranks x ``D`` copies x ``T`` tensor-parallel ranks,
a micro-batch size, and what :func:`twobp.sim.search.search` chooses for it:
schedule, 2BP policy, stages per rank, ``W`` cap. Each rank's weights are
subtracted from the device memory, and the search keeps the rest (gradients,
optimizer state, activations and stashes) under it. With ``D > 1`` the optimizer
state is sharded over the copies (``pipe.shard_optimizer``); with
``shard_parameters`` the layouts are searched with the parameters and gradients
sharded too (``Pipeline(shard_parameters=True)``) and without: a rank then keeps
``1 / D`` of its weights, gradients and optimizer state, holds a stage's whole weights
from its first ``F`` to its last ``I`` (``CostModel.gathered_bytes``), and each step
all-gathers every stage's weights and reduce-scatters its gradients, as the
simulator times them (``CostModel.shard_parameters``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from twobp.schedule import SCHEDULES
from twobp.sim.analytic.hardware import Hardware
from twobp.sim.analytic.shapes import (
    DTYPE_BYTES,
    BlockCosts,
    DecoderShape,
    block_costs,
    head_costs,
)
from twobp.sim.candidate import Candidate
from twobp.sim.costs import CostModel, allreduce_time
from twobp.sim.recompute import NO_RECOMPUTE
from twobp.sim.search import NothingFitsError, choose, options, search

SCHEDULES_TRIED = ("1f1b", "zb-h1", "zb-v", "dualpipev")
POLICIES_TRIED = ("off", "eager")
RECOMPUTE_TRIED = ("activations", "all")
"""The recompute modes tried where a layout fits no other way."""
STEP_WHOLE = "activations and stashes"
"""The part of a layout's memory that the step holds, with whole parameters."""
STEP_SHARDED = "gathered weights, whole gradients, activations and stashes"
"""The same with sharded parameters: what the simulator holds at the peak of them all."""


@dataclass(frozen=True)
class Layout:
    """One layout and its simulated best candidate.

    ``memory`` is the peak per rank broken down, in bytes: weights, gradients,
    optimizer state (what a rank keeps between steps) and what the step holds at its peak
    (:data:`STEP_WHOLE`, or with sharded parameters :data:`STEP_SHARDED`).
    """

    pipeline: int
    data: int
    tensor: int
    microbatch: int
    microbatches: int
    shard_optimizer: bool
    candidate: Candidate
    step: float
    tokens_per_second: float
    mfu: float
    memory: dict[str, float]
    shard_parameters: bool = False

    def two_bp(self) -> str:
        """``off`` (fused backwards), ``own`` (a schedule split by its own design, as
        generated: ``zb-*``, ``dualpipev``) or the 2BP policy that places ``W``."""
        c = self.candidate
        if c.policy != "off":
            return c.policy
        return "own" if SCHEDULES[c.schedule].natively_split else "off"

    def options(self) -> str:
        """The ``twobp train`` options that run it."""
        c = self.candidate
        parts = [
            f"--ranks {self.pipeline * self.data * self.tensor}",
            f"--data-parallel {self.data}" if self.data > 1 else "",
            f"--schedule {c.schedule}",
            {"own": "--two-bp", "off": "--no-two-bp"}.get(
                self.two_bp(), f"--two-bp --policy {c.policy}"
            ),
            f"--microbatches {self.microbatches}",
            f"--batch-size {self.microbatches * self.microbatch * self.data}",
            f"--stages-per-rank {c.stages_per_rank}" if (c.stages_per_rank or 1) > 1 else "",
            "--shard-optimizer" if self.shard_optimizer and not self.shard_parameters else "",
            "--shard-parameters" if self.shard_parameters else "",
            f"--recompute {c.recompute}" if c.recompute != NO_RECOMPUTE else "",
        ]
        if self.tensor > 1:
            parts.append(f"--tensor-parallel {self.tensor}")
        return " ".join(p for p in parts if p)

    def pipeline_options(self) -> str:
        """The :class:`twobp.Pipeline` keywords that run it."""
        c = self.candidate
        parts = [
            f"schedule={c.schedule!r}",
            f"n_microbatches={self.microbatches}",
            {"own": "two_bp=True", "off": "two_bp=False"}.get(
                self.two_bp(), f"two_bp=True, two_bp_policy={c.policy!r}"
            ),
            f"stages_per_rank={c.stages_per_rank}" if (c.stages_per_rank or 1) > 1 else "",
            f"data_parallel={self.data}" if self.data > 1 else "",
            f"tensor_parallel={self.tensor}, tensor_parallel_plan=PLAN" if self.tensor > 1 else "",
            f"recompute={c.recompute!r}" if c.recompute != NO_RECOMPUTE else "",
            "shard_parameters=True" if self.shard_parameters else "",
        ]
        text = f"Pipeline(blocks, loss_fn, {', '.join(p for p in parts if p)})"
        if self.shard_optimizer:
            text += ", then pipe.shard_optimizer(...)"
        return text


def stage_costs(
    shape: DecoderShape,
    device: Hardware,
    block: BlockCosts,
    pipeline: int,
    tensor: int,
    dtype: str,
    head: BlockCosts | None = None,
) -> tuple[CostModel, tuple[float, ...]]:
    """The cost model of ``pipeline`` stages of equal layers, and the weight bytes of
    each stage. With ``head`` (:func:`head_costs`), the first stage holds
    the embedding too (its lookup costs no time) and the last the head."""
    per_stage = -(-shape.layers // pipeline)
    seconds = device.seconds
    # Tensor parallelism all-reduces the hidden states twice per layer in F and twice in I.
    tp = (
        2 * allreduce_time(block.send_bytes, tensor, device.intra_bandwidth, 0.0)
        if tensor > 1
        else 0.0
    )
    f = per_stage * (
        seconds(block.forward_matmul, "matmul", dtype)
        + seconds(block.forward_attention, "attention", dtype)
        + tp
    )
    i = per_stage * (
        seconds(block.input_matmul, "matmul", dtype)
        + seconds(block.input_attention, "attention", dtype)
        + tp
    )
    w = per_stage * seconds(block.weight_matmul, "matmul", dtype)
    crosses = pipeline * tensor > device.per_node
    costs = CostModel.uniform(
        pipeline,
        f,
        i,
        w,
        bandwidth=device.inter_bandwidth if crosses else device.intra_bandwidth,
        send_bytes=block.send_bytes / tensor,
        send_latency=10e-6,
        activation_bytes=per_stage * block.activation_bytes,
        weight_grad_bytes=per_stage * block.stash_bytes,
        parameter_bytes=per_stage * block.gradient_bytes,
        optimizer_bytes=per_stage * block.optimizer_bytes,
        reduce_bandwidth=device.inter_bandwidth,
        contention=device.contention,
    )
    if head is None:
        return costs, (per_stage * block.parameter_bytes,) * pipeline
    size = DTYPE_BYTES[dtype]
    embedding = shape.vocab * shape.hidden / tensor * size
    embedding_state = embedding * head.optimizer_bytes / head.parameter_bytes
    first = {"parameter": embedding, "optimizer": embedding_state}
    end = {
        "forward": seconds(head.forward_matmul, "matmul", dtype),
        "backward_input": seconds(head.input_matmul, "matmul", dtype),
        "backward_weight": seconds(head.weight_matmul, "matmul", dtype),
        "activation": head.activation_bytes,
        "weight_grad": head.stash_bytes,
        "parameter": head.gradient_bytes,
        "optimizer": head.optimizer_bytes,
    }

    def ends(values: Sequence[float] | None, key: str) -> tuple[float, ...]:
        out = list(values or (0.0,) * pipeline)
        out[0] += first.get(key, 0.0)
        out[-1] += end.get(key, 0.0)
        return tuple(out)

    costs = replace(
        costs,
        forward=ends(costs.forward, "forward"),
        backward_input=ends(costs.backward_input, "backward_input"),
        backward_weight=ends(costs.backward_weight, "backward_weight"),
        backward_full=None,
        activation_bytes=ends(costs.activation_bytes, "activation"),
        weight_grad_bytes=ends(costs.weight_grad_bytes, "weight_grad"),
        parameter_bytes=ends(costs.parameter_bytes, "parameter"),
        optimizer_bytes=ends(costs.optimizer_bytes, "optimizer"),
    )
    weights = [per_stage * block.parameter_bytes] * pipeline
    weights[0] += embedding
    weights[-1] += head.parameter_bytes
    return costs, tuple(weights)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan_layouts(
    shape: DecoderShape,
    device: Hardware,
    gpus: int,
    global_batch: int,
    seq_len: int,
    dtype: str = "bfloat16",
    *,
    tensor_sizes: Sequence[int] = (1, 2, 4, 8),
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    max_microbatches: int = 64,
    schedules: Sequence[str] = SCHEDULES_TRIED,
    policies: Sequence[str] = POLICIES_TRIED,
    shard_parameters: Sequence[bool] = (False,),
) -> list[Layout]:
    """Every layout that fits, fastest first (empty: none fits), each with the best of
    ``schedules`` x ``policies``. Recomputation costs time: its modes
    (:data:`RECOMPUTE_TRIED`) are tried only where no layout fits without.
    ``shard_parameters``: the settings of ``Pipeline(shard_parameters=...)`` to search
    where ``D > 1`` (``(False, True)``: both, each a layout of its own)."""
    for recomputes in ((NO_RECOMPUTE,), RECOMPUTE_TRIED):
        dims = (gpus, global_batch, seq_len, dtype)
        out = _layouts(
            shape,
            device,
            dims,
            (tensor_sizes, microbatch_sizes, max_microbatches),
            (tuple(schedules), tuple(policies), recomputes),
            tuple(shard_parameters),
        )
        if out:
            break
    return out


def _layouts(
    shape: DecoderShape,
    device: Hardware,
    dims: tuple[int, int, int, str],
    sizes: tuple[Sequence[int], Sequence[int], int],
    tried: tuple[Sequence[str], Sequence[str], Sequence[str]],
    shard_parameters: tuple[bool, ...] = (False,),
) -> list[Layout]:
    gpus, global_batch, seq_len, dtype = dims
    tensor_sizes, microbatch_sizes, max_microbatches = sizes
    out = []
    for tensor in tensor_sizes:
        if gpus % tensor or tensor > device.per_node or shape.heads % tensor:
            continue
        for pipeline in _divisors(gpus // tensor):
            if pipeline < 2 or pipeline > shape.layers:
                continue
            data = gpus // (tensor * pipeline)
            for mb in microbatch_sizes:
                if global_batch % (data * mb):
                    continue
                m = global_batch // (data * mb)
                if m < pipeline or m > max_microbatches:
                    continue
                for sharded in shard_parameters if data > 1 else (False,):
                    layout = best_layout(
                        shape,
                        device,
                        (pipeline, data, tensor, mb, m, seq_len),
                        (data > 1, sharded),
                        dtype,
                        tried,
                    )
                    if layout is not None:
                        out.append(layout)
    return sorted(out, key=lambda x: x.step)


def layout_costs(
    shape: DecoderShape,
    device: Hardware,
    dims: tuple[int, int, int, int, int, int],
    shard: tuple[bool, bool],
    dtype: str,
) -> tuple[CostModel, tuple[float, ...], float]:
    """The cost model of a layout's stages, each stage's whole weights, and the weight
    bytes a rank keeps between steps.

    Args:
        shape: the decoder.
        device: the hardware.
        dims: ``(P, D, T, micro-batch size, micro-batches, sequence length)``.
        shard: whether the optimizer state is sharded over the ``D`` copies, and whether
            the parameters and gradients are too (``CostModel.shard_parameters``).
        dtype: of the weights and compute.
    """
    pipeline, data, tensor, mb, _, seq_len = dims
    shard_optimizer, shard_parameters = shard
    block = block_costs(shape, seq_len, mb, dtype, tensor)
    head = head_costs(shape, seq_len, mb, dtype, tensor)
    costs, stage_weights = stage_costs(shape, device, block, pipeline, tensor, dtype, head)
    if shard_optimizer:
        # Each step gathers the stages' updated weights, waited for block by block (a
        # layer at a time) by the stage's first F.
        costs = replace(costs, shard_optimizer=True, gather_pieces=-(-shape.layers // pipeline))
    weights = max(stage_weights)
    if shard_parameters:
        # The rank keeps 1/D of its weights; each stage's whole weights are gathered
        # within the step (the same gathers), held from its first F to its last I.
        weights /= data
        costs = replace(costs, shard_parameters=True, gathered_bytes=stage_weights)
    return costs, stage_weights, weights


def best_layout(
    shape: DecoderShape,
    device: Hardware,
    dims: tuple[int, int, int, int, int, int],
    shard: tuple[bool, bool],
    dtype: str,
    tried: tuple[Sequence[str], Sequence[str], Sequence[str]] = (
        SCHEDULES_TRIED,
        POLICIES_TRIED,
        (NO_RECOMPUTE,),
    ),
) -> Layout | None:
    """The fastest candidate of one layout that fits the device (None: none fits).

    Args:
        shape, device, dims, shard, dtype: as for :func:`layout_costs`.
        tried: the schedules, 2BP policies and recompute modes searched.
    """
    schedules, policies, recomputes = tried
    pipeline, data, tensor, mb, m, seq_len = dims
    shard_optimizer, shard_parameters = shard
    costs, _, weights = layout_costs(shape, device, dims, shard, dtype)
    limit = device.memory - weights
    if limit <= 0:
        return None
    choices = options(
        m,
        schedules=schedules,
        policies=policies,
        max_stages_per_rank=1,
        recomputes=recomputes,
    )
    ranking = search(choices, pipeline, m, costs.for_stages, limit, data)
    try:
        best = choose(ranking, limit)
    except NothingFitsError:
        return None
    tokens = m * mb * data * seq_len
    per_device = shape.active_block_params * shape.layers + shape.vocab * shape.hidden
    model_flops = 6.0 * per_device * tokens + 12.0 * shape.layers * seq_len * shape.hidden * tokens
    mfu = model_flops / (best.makespan * pipeline * data * tensor * device.peak(dtype))
    gradients = max(costs.parameter_bytes or (0.0,)) / (data if shard_parameters else 1)
    optimizer = max(costs.optimizer_bytes or (0.0,)) / (data if shard_optimizer else 1)
    static = gradients + optimizer
    memory = {"weights": weights, "gradients": gradients, "optimizer": optimizer}
    # Sharded, the step holds a stage's whole weights from its first F to its last I, and
    # its whole gradients from its first W to its R, besides activations and stashes.
    step_part = STEP_SHARDED if shard_parameters else STEP_WHOLE
    memory[step_part] = max(best.peak_memory - static, 0.0)
    return Layout(
        pipeline,
        data,
        tensor,
        mb,
        m,
        shard_optimizer,
        best,
        best.makespan,
        tokens / best.makespan,
        mfu,
        memory,
        shard_parameters,
    )
