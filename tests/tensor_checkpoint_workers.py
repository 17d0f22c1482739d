"""What the tests of tensor-parallel checkpoints run on every rank of a launched group of 4.

A run is a list of phases on one tiny LLaMA (float64): each builds a pipeline of a layout
``(D, P, T)`` (data parallel x pipeline x tensor parallel, ``P`` implied), loads a
checkpoint or not, takes AdamW steps, and saves or not. Every step's loss and the
parameters after the last step are compared with one process on the whole model.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tensor_parallel_pipeline_workers import LLAMA, _llama, _whole
from twobp.models import build_model, tensor_parallel_plan
from twobp.runtime import Pipeline
from twobp.runtime.base.tensor_split import split_dims

BATCH = 16
LR = 1e-2


@dataclass(frozen=True)
class Phase:
    """One pipeline: its layout, what it loads, its steps, where it saves."""

    data_parallel: int
    tensor_parallel: int
    steps: range
    load: str | None = None
    save: str | None = None
    optimizer: str = "plain"
    """``"plain"`` (AdamW over the parameters), ``"sharded"`` (``shard_optimizer``) or
    ``"parameters"`` (``shard_parameters=True`` with ``shard_optimizer``)."""
    async_save: bool = False
    head: str = "whole"
    """The embedding and head, as :data:`tensor_parallel_pipeline_workers.HEADS` says."""


def _reference(steps: int, head: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process: each step's loss, and the state dict after each step."""
    spec, _ = _llama(head)
    whole = nn.Sequential(*spec.blocks)
    optimizer = torch.optim.AdamW(whole.parameters(), lr=LR)
    losses, states = [], []
    for step in range(steps):
        inputs, targets = spec.make_batch(BATCH, step)
        optimizer.zero_grad()
        loss = spec.loss_fn(whole(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        states.append({k: v.detach().clone() for k, v in whole.state_dict().items()})
    return losses, states


def _pipeline(phase: Phase) -> tuple[Pipeline, torch.optim.Optimizer]:
    spec, plan = _llama(phase.head)
    blocks = spec.blocks
    if phase.load is not None:  # other weights than the saved ones: the load must set them
        for block in blocks:
            for p in block.parameters():
                p.data.normal_()
    tp = phase.tensor_parallel
    pipe = Pipeline(
        blocks,
        spec.loss_fn,
        "1f1b",
        n_microbatches=4,
        data_parallel=phase.data_parallel,
        tensor_parallel=tp,
        tensor_parallel_plan=plan if tp > 1 else None,
        shard_parameters=phase.optimizer == "parameters",
    )
    optimizer = (
        torch.optim.AdamW(pipe.parameters(), lr=LR)
        if phase.optimizer == "plain"
        else pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    )
    return pipe, optimizer


def run_phases(phases: list[Phase]) -> dict[str, Any]:
    """Every phase on this rank. Returns the largest differences from one process (``loss``
    over every step, ``parameters`` after each phase's last step, joined over the
    tensor-parallel group), what this rank holds split in the first phase that saves
    (``split``: name -> its shard's shape, its dim and its tensor-parallel rank), and on
    rank 0 the reference state dicts after each step, by head (``reference``)."""
    steps = max(p.steps.stop for p in phases)
    references = {head: _reference(steps, head) for head in {p.head for p in phases}}
    errors: dict[str, Any] = {"loss": 0.0, "parameters": 0.0, "split": None}
    for phase in phases:
        spec, _ = _llama(phase.head)
        losses, states = references[phase.head]
        pipe, optimizer = _pipeline(phase)
        if phase.load is not None:
            pipe.load(phase.load, optimizer)
            assert pipe.step_count == phase.steps.start, pipe.step_count
        copies = pipe.dp_size
        for step in phase.steps:
            inputs, targets = spec.make_batch(BATCH, step)
            mine = slice(BATCH // copies * pipe.dp_rank, BATCH // copies * (pipe.dp_rank + 1))
            pipe.zero_grad()
            loss = pipe.step(inputs[mine], targets[mine])
            optimizer.step()
            errors["loss"] = max(errors["loss"], abs(loss - losses[step]))
        expected = states[phase.steps.stop - 1]
        sharded = pipe.state.sharded
        with sharded.gathered() if sharded is not None else contextlib.nullcontext():
            for name, param in pipe.state.named_parameters():
                joined = _whole(pipe, param.detach(), param)
                errors["parameters"] = max(
                    errors["parameters"], float((joined - expected[name]).abs().max())
                )
        if phase.save is not None:
            pipe.save(phase.save, optimizer, async_save=phase.async_save)
            pipe.wait_for_checkpoint()
            if errors["split"] is None and phase.tensor_parallel > 1:
                dims = split_dims(pipe.module)
                errors["split"] = {
                    name: (list(p.shape), dims[id(p)], pipe.tp_rank)
                    for name, p in pipe.named_parameters()
                    if id(p) in dims and pipe.state.writes(name)
                }
        pipe.close()
    errors["rank"] = dist.get_rank()
    errors["reference"] = (
        {head: copy.deepcopy(states) for head, (_, states) in references.items()}
        if dist.get_rank() == 0
        else None
    )
    return errors


def half_precision_resumes(folder: str) -> tuple[list[float], list[float]]:
    """D 2 x T 2 in bfloat16 with a sharded optimizer (float32 master shards): 4 steps,
    saved after 2; the last 2 steps' losses, and those of a pipeline that loads the
    checkpoint and runs them again."""
    runs = []
    for steps in (range(0, 4), range(2, 4)):
        spec = build_model("llama", "tiny", dtype=torch.bfloat16, **LLAMA)
        pipe = Pipeline(
            spec.blocks,
            spec.loss_fn,
            "1f1b",
            n_microbatches=4,
            data_parallel=2,
            tensor_parallel=2,
            tensor_parallel_plan=tensor_parallel_plan("llama"),
        )
        optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
        if steps.start:
            pipe.load(folder, optimizer)
        losses = []
        for step in steps:
            inputs, targets = spec.make_batch(BATCH, step)
            mine = slice(BATCH // 2 * pipe.dp_rank, BATCH // 2 * (pipe.dp_rank + 1))
            losses.append(pipe.step(inputs[mine], targets[mine]))
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                pipe.save(folder, optimizer)
        runs.append(losses[-2:])
        pipe.close()
    return runs[0], runs[1]
