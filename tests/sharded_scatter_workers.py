"""Functions the tests of gradients reduce-scattered after each W run on every rank."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime_models import LR, N_STEPS, WIDTH, build_blocks, loss_fn, make_batch
from sharded_parameters_workers import N_MB, PART, batch_of
from twobp.runtime import Pipeline


class TiedPair(nn.Module):
    """Two linears of one block that share their weight (tied within a stage)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def blocks(model: str) -> list[nn.Module]:
    """The MLP's blocks; ``tied``: its first block followed by a block tying two linears."""
    made = build_blocks("mlp")
    if model == "tied":
        torch.manual_seed(7)
        made.insert(1, TiedPair(WIDTH).double())
    return made


def pipeline(
    schedule: str, scatter_each_w: bool | None, example_rows: int | None = None, **options: Any
) -> Pipeline:
    pipe = Pipeline(
        options.pop("blocks", None) or build_blocks("mlp"),
        loss_fn("mlp"),
        schedule=schedule,
        two_bp=True,
        device="cpu",
        timeout=60.0,
        n_microbatches=N_MB,
        data_parallel=2,
        shard_parameters=True,
        scatter_each_w=scatter_each_w,
        **options,
    )
    # A V without an example input balances on its first step's inputs: plan on them now.
    rows = PART if example_rows is None else example_rows
    pipe.plan_on(make_batch("mlp", 0, rows)[0])
    assert pipe.state.sharded is not None
    assert pipe.state.sharded.scatter_each_w is scatter_each_w
    return pipe


def train(case: tuple[str, str, int, str, bool | None]) -> dict[str, Any]:
    """3 AdamW steps of ``accumulate`` pipeline steps each, gradients reduce-scattered as
    ``scatter_each_w`` says; losses, parameters and whether a W reduce-scattered."""
    schedule, policy, accumulate, model, scatter_each_w = case
    torch.set_num_threads(1)
    pipe = pipeline(schedule, scatter_each_w, two_bp_policy=policy, blocks=blocks(model))
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    losses, scattered = [], []
    for step in range(N_STEPS):
        for micro in range(accumulate):
            inputs, targets = batch_of(step, micro, pipe.dp_size)
            part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
            losses.append(pipe.step(inputs[part], targets[part]))
            scattered.append(pipe.memory_stats(optimizer)["scatter_each_w"])
        optimizer.step()
        optimizer.zero_grad()
    out = {"losses": losses, "state": pipe.state_dict(), "scattered": scattered}
    pipe.close()
    return out


def train_many(cases: list[tuple[str, str, int, str, bool | None]]) -> dict[str, Any]:
    """:func:`train` of every case, keyed by its text."""
    return {repr(c): train(c) for c in cases}


def gradient_peaks(schedules: list[tuple[str, str]], rows: int) -> dict[str, Any]:
    """Per schedule and 2BP policy, one step with the gradients reduce-scattered after
    each W and one at R, ``recompute="activations"``, ``rows`` rows a copy: each run's
    ``memory_stats`` and the schedule the pipeline ran."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    inputs, targets = make_batch("mlp", 0, 2 * rows)
    for schedule, policy in schedules:
        runs = {}
        for each in (True, False):
            pipe = pipeline(schedule, each, rows, recompute="activations", two_bp_policy=policy)
            optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
            part = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
            for _ in range(2):  # the first step watches the forwards' saved tensors
                pipe.step(inputs[part], targets[part])
            runs[each] = pipe.memory_stats(optimizer)
            compute = pipe.schedule
            pipe.close()
        out[f"{schedule} {policy}"] = {"runs": runs, "schedule": compute}
    return out
