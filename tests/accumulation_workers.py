"""Functions the gradient-accumulation tests run on every rank of a launched group."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime_models import build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline

PART = 8  # samples per data-parallel copy
BAD = -7  # a target value on which the loss raises


def _raising_loss(model: str) -> Any:
    base = loss_fn(model)

    def loss(outputs: Any, targets: Tensor) -> Tensor:
        if bool((targets == BAD).any()):
            raise ValueError("this micro-batch's targets hold the bad value")
        return base(outputs, targets)

    return loss


def _part(pipe: Pipeline, model: str, step: int) -> tuple[Any, Tensor]:
    inputs, targets = make_batch(model, step, PART * pipe.dp_size)
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    inputs = tuple(t[part] for t in inputs) if isinstance(inputs, tuple) else inputs[part]
    return inputs, targets[part]


def _grads(pipe: Pipeline) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def accumulate(model: str, schedule: str, two_bp: bool, options: dict[str, Any]) -> dict[str, Any]:
    """Steps 0 and 1 alone, then accumulated, with a failed and a skipped step between.

    Returns:
        ``alone``: the gradients of each step run alone; ``after_failure``
        and ``after_skip``: the gradients after step 0 and then a step that
        failed (in the loss of its last micro-batch) or was skipped (a NaN input, only
        for float inputs); ``together``: after step 0, those, and step 1;
        ``failure``: the type of error the failed step raised here.
    """
    torch.set_num_threads(1)
    pipe = Pipeline(
        build_blocks(model),
        _raising_loss(model),
        schedule=schedule,
        n_microbatches=options.get("n_microbatches", 4),
        two_bp=two_bp,
        device="cpu",
        timeout=30.0,
        nonfinite="skip",
        data_parallel=options.get("data_parallel", 1),
    )
    alone = []
    for step in (0, 1):
        pipe.step(*_part(pipe, model, step))
        alone.append(_grads(pipe))
        pipe.zero_grad()
    pipe.step(*_part(pipe, model, 0))
    inputs, targets = _part(pipe, model, 1)
    wrong = targets.clone()
    wrong[-1] = BAD  # the last micro-batch's loss raises, after the others' backward ran
    failure = "none"
    try:
        pipe.step(inputs, wrong)
    except Exception as exc:
        failure = type(exc).__name__
    after_failure = _grads(pipe)
    after_skip = after_failure
    if isinstance(inputs, Tensor) and inputs.is_floating_point():
        pipe.step(torch.full_like(inputs, float("nan")), targets)
        after_skip = _grads(pipe)
    pipe.step(inputs, targets)
    return {
        "alone": alone,
        "after_failure": after_failure,
        "after_skip": after_skip,
        "together": _grads(pipe),
        "failure": failure,
        "skipped": list(pipe.skipped_steps),
    }


def accumulate_many(cases: list[tuple[str, str, bool, dict[str, Any]]]) -> dict[str, Any]:
    """:func:`accumulate` of every case, keyed by its text."""
    return {repr(c): accumulate(*c) for c in cases}
