"""What the sharded-optimizer (ZeRO-1) case tests run on every rank of a launched group.

Each case trains 2 copies of a 2-rank pipeline through ``pipe.shard_optimizer``
and returns what plain PyTorch on one process must equal: the global norm
before clipping and the parameters (and buffers) after every optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime_models import LR, build_blocks, loss_fn, make_batch
from twobp.runtime import PeerStepFailedError, Pipeline

N_MB = 4
PART = 8
"""Samples per data-parallel copy."""
COPIES = 2
CLIP = 1e9
"""Large: the norm is measured, no step is clipped (the reference need not clip)."""
FAIL_AT = 1234.0
"""A target value on which :func:`summed_loss` raises (a step that fails on one rank)."""


def summed_loss(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum, count)``: squared errors of the rows whose weight (the last target column)
    is 1, and how many such rows; padded rows (weight 0) do not count."""
    if bool((target == FAIL_AT).any()):
        raise ValueError("this loss fails on purpose")
    weight = target[:, -1]
    total = ((output - target[:, :-1]) ** 2).sum(dim=1)
    return (total * weight).sum(), weight.sum()


def weighted_batch(step: int, size: int) -> tuple[Tensor, Tensor]:
    """The mlp's batch of ``step`` with a padding column: about 40% of rows padded,
    unevenly over micro-batches and copies."""
    inputs, targets = make_batch("mlp", step, size)
    gen = torch.Generator().manual_seed(500 + step)
    weight = (torch.rand(size, generator=gen) > 0.4).to(targets.dtype)
    weight[0] = 1.0
    return inputs, torch.cat([targets, weight[:, None]], dim=1)


def batch_of(case: str, step: int, size: int) -> tuple[Tensor, Tensor]:
    """The global batch of ``case`` at ``step``."""
    if case == "batchnorm":
        return make_batch("conv", step, size)
    if case in ("sum count", "accumulate sum count", "failed", "skipped"):
        return weighted_batch(step, size)
    return make_batch("mlp", step, size)


def pipeline_of(case: str) -> Pipeline:
    model = "conv" if case == "batchnorm" else "mlp"
    summed = case not in ("batchnorm", "accumulate")
    return Pipeline(
        build_blocks(model),
        summed_loss if summed else loss_fn(model),
        schedule="1f1b",
        n_microbatches=N_MB,
        two_bp=True,
        data_parallel=COPIES,
        device="cpu",
        timeout=60.0,
        nonfinite="skip" if case == "skipped" else "raise",
    )


# The batches of each optimizer step: one step each, or several accumulated; "fail"
# and "nan" mark a pipeline step that fails on one rank, or whose loss is NaN.
PLAN: dict[str, list[list[int | str]]] = {
    "sum count": [[0], [1], [2]],
    "accumulate": [[0, 1], [2, 3]],
    "accumulate sum count": [[0, 1], [2, 3]],
    "failed": [[0, "fail", 1], [2]],
    "skipped": [[0, "nan", 1], [2]],
    "batchnorm": [[0], [1], [2]],
}


def _own(pipe: Pipeline, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    rows = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    return batch[0][rows], batch[1][rows]


def train(case: str) -> dict[str, Any]:
    """Every optimizer step of :data:`PLAN` ``[case]`` through a sharded AdamW."""
    torch.set_num_threads(1)
    pipe = pipeline_of(case)
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    norms, failures, states = [], [], []
    for steps in PLAN[case]:
        for step in steps:
            if isinstance(step, int):
                pipe.step(*_own(pipe, batch_of(case, step, PART * COPIES)))
                continue
            inputs, targets = _own(pipe, batch_of(case, 9, PART * COPIES))
            targets = targets.clone()
            if step == "nan":
                targets[0, 0] = float("nan")
            elif pipe.dp_rank == 1:
                targets[-1, 0] = FAIL_AT  # one copy's last micro-batch fails
            try:
                pipe.step(inputs, targets)
                failures.append("no error")
            except (ValueError, PeerStepFailedError) as error:
                failures.append(type(error).__name__)
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.clone() for k, v in pipe.state_dict().items()})
    out = {
        "norms": norms,
        "states": states,
        "failures": failures,
        "skipped": list(pipe.skipped_steps),
    }
    pipe.close()
    return out


def every_case(cases: list[str]) -> dict[str, Any]:
    """:func:`train` of each case, in one group."""
    return {case: train(case) for case in cases}
