"""Functions the tests of sharded parameters under two pipelines run on every rank."""

from __future__ import annotations

from typing import Any

import torch

from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline
from twobp.runtime.communication import reduction

PART = 8  # samples per data-parallel copy and step
CLIP = 0.05  # small enough that every step clips
SMALL_BUCKETS = 600  # bytes: about one linear layer's float64 parameters a bucket


def train(
    schedule: str,
    copies: int,
    n_microbatches: int,
    scatter_each_w: bool | None,
    small_buckets: bool,
    model: str = "mlp",
) -> dict[str, Any]:
    """3 clipped AdamW steps with parameters sharded over every holder of a stage (of
    ``model``: ``"tied"`` ties its embedding and head, on the first and the last stage)."""
    torch.set_num_threads(1)
    if small_buckets:
        # Several buckets, so several gathers and reduce-scatters, on each stage's group.
        reduction.BUCKET_BYTES = SMALL_BUCKETS
    pipe = Pipeline(
        build_blocks(model),
        loss_fn(model),
        schedule=schedule,
        n_microbatches=n_microbatches,
        two_bp=True,
        device="cpu",
        timeout=30.0,
        data_parallel=copies,
        shard_parameters=True,
        scatter_each_w=scatter_each_w,
    )
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    # Chimera and DualPipe on 4 ranks balance their ends on the first step's inputs: plan
    # on them now, to shard the parameters as they will be held.
    pipe.plan_on(_part(make_batch(model, 0, PART * copies)[0], part))
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    assert pipe.state.sharded is not None
    buckets = {}
    for shard in pipe.state.sharded.shards:
        buckets[shard.bucket.key] = buckets.get(shard.bucket.key, 0) + 1
    between = [p.untyped_storage().nbytes() for p in pipe.state.parameters()]
    losses, norms, scattered = [], [], []
    for step in range(N_STEPS):
        inputs, targets = make_batch(model, step, PART * copies)
        losses.append(pipe.step(_part(inputs, part), targets[part]))
        scattered.append(pipe.state.sharded.scattered_each_w)
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        optimizer.step()
        if step == N_STEPS - 1:
            stats = pipe.memory_stats(optimizer)
        optimizer.zero_grad()
    full = sum(p.numel() * p.element_size() for p in pipe.state.parameters())
    state = pipe.state_dict()
    pipe.close()
    return {
        "losses": losses,
        "norms": norms,
        "state": state,
        "between": between,
        "scattered each W": scattered,
        "buckets": buckets,
        "held": stats["parameters"] + stats["optimizer"],
        # Parameters, gradients and AdamW's two moments, unsharded.
        "unsharded": 4 * full,
    }


def train_many(cases: list[tuple[Any, ...]]) -> dict[str, Any]:
    """:func:`train` of every case, keyed by its text."""
    return {repr(c): train(*c) for c in cases}


def _part(inputs: Any, part: slice) -> Any:
    return tuple(t[part] for t in inputs) if isinstance(inputs, tuple) else inputs[part]
