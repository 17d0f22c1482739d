"""Functions the accumulation-by-schedule tests run on every rank, and their plain references.

A case trains :data:`K` steps on :data:`K` batches without ``zero_grad`` between
them and returns the gradients it accumulated. With ``shard_optimizer`` the
parameters keep no gradient of their own (each rank holds its shard of the
sum), so the case steps an SGD of learning rate 1 through
``pipe.shard_optimizer`` and returns what it took off each parameter: the
accumulated gradient, whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from runtime_models import build_blocks, loss_fn, make_batch, reference_step
from twobp.runtime import Pipeline

K = 3  # steps accumulated
N_MB = 4
BATCH = 2 * N_MB

Case = tuple[str, str, bool, dict[str, Any]]
"""(model, schedule, two_bp, options): options are Pipeline's keywords, and
``shard_optimizer=True`` or ``autocast=torch.bfloat16`` (float32 blocks then)."""


def _blocks(model: str, options: dict[str, Any]) -> list[nn.Module]:
    blocks = build_blocks(model)
    return [b.float() for b in blocks] if "autocast" in options else blocks


def _batch(model: str, step: int, options: dict[str, Any]) -> tuple[Any, Tensor]:
    inputs, targets = make_batch(model, step, BATCH)
    if "autocast" in options:
        return inputs.float(), targets.float()
    return inputs, targets


def accumulate(model: str, schedule: str, two_bp: bool, options: dict[str, Any]) -> dict[str, Any]:
    """:data:`K` steps of ``model`` without ``zero_grad``: this rank's accumulated gradients."""
    options = dict(options)
    sharded = options.pop("shard_optimizer", False)
    pipe = Pipeline(
        _blocks(model, options),
        loss_fn(model),
        schedule=schedule,
        n_microbatches=N_MB,
        two_bp=two_bp,
        device="cpu",
        timeout=30.0,
        **options,
    )
    with pipe:
        optimizer = pipe.shard_optimizer(torch.optim.SGD, lr=1.0) if sharded else None
        before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        for step in range(K):
            pipe.step(*_batch(model, step, options))
        if optimizer is None:
            return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        optimizer.step()
        return {n: before[n] - p.detach() for n, p in pipe.named_parameters()}


def accumulate_many(cases: list[Case]) -> dict[str, Any]:
    """:func:`accumulate` of every case, keyed by its text."""
    torch.set_num_threads(1)
    return {repr(c): accumulate(*c) for c in cases}


def reference(model: str, options: dict[str, Any]) -> dict[str, Tensor]:
    """The gradients one process accumulates over the same :data:`K` batches.

    Under ``autocast`` each micro-batch's forward and loss run in autocast, as
    the pipeline's stages do; else the whole batch at once, in float64.
    """
    net = nn.Sequential(*_blocks(model, options))
    loss_of = loss_fn(model)
    for step in range(K):
        inputs, targets = _batch(model, step, options)
        if "autocast" not in options:
            reference_step(net, model, inputs, targets, N_MB)
            continue
        for x, y in zip(inputs.chunk(N_MB), targets.chunk(N_MB), strict=True):
            with torch.autocast("cpu", dtype=options["autocast"]):
                loss = loss_of(net(x), y) / N_MB
            loss.backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}
