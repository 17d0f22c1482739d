"""What the tests of an optimizer built before planning run on every rank of a launched group.

A pipeline that plans at its first step (``schedule="auto"`` without an example
input, or ``recompute="auto"`` without one) lists every block's parameters until
then; an AdamW built on that list must train exactly as plain PyTorch does.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline

PART = 8
"""Samples per data-parallel copy."""


def _part(pipe: Pipeline, step: int, copies: int) -> tuple[Any, Any]:
    (ids, keep), targets = make_batch("tied", step, PART * copies)
    rows = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    return (ids[rows], keep[rows]), targets[rows]


def trained_with_an_early_optimizer(schedule: str, options: dict[str, Any]) -> dict[str, Any]:
    """The tied model: AdamW built on ``parameters()`` before the first step plans, then
    :data:`N_STEPS` steps. What the lists held before planning, and the state after."""
    torch.set_num_threads(1)
    pipe = Pipeline(
        build_blocks("tied"),
        loss_fn("tied"),
        schedule=schedule,
        device="cpu",
        timeout=120.0,
        **options,
    )
    early = pipe.plan is None and "schedule" not in pipe.__dict__
    listed = list(pipe.parameters())
    named = list(pipe.named_parameters())
    buffers = list(pipe.named_buffers())
    optimizer = torch.optim.AdamW(listed, lr=LR, weight_decay=0.1)
    copies = options.get("data_parallel", 1)
    losses = []
    for step in range(N_STEPS):
        losses.append(pipe.step(*_part(pipe, step, copies)))
        optimizer.step()
        optimizer.zero_grad()
    out = {
        "early": early,
        "listed": len(listed),
        "distinct": len({id(p) for p in listed}),
        "named": [n for n, _ in named],
        "named distinct": len({id(p) for _, p in named}),
        "buffers": len(buffers),
        "after": len(list(pipe.parameters())),
        "after distinct": len({id(p) for p in pipe.parameters()}),
        "schedule": pipe.schedule.name,
        "losses": losses,
        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
    }
    pipe.close()
    return out


def every_case(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """:func:`trained_with_an_early_optimizer` of each case, in one group."""
    return [trained_with_an_early_optimizer(schedule, dict(o)) for schedule, o in cases]
