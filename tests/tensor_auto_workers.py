"""Functions the tests of ``schedule="auto"`` over tensor-parallel sizes run on every rank."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from tensor_parallel_pipeline_workers import _llama, _whole
from twobp.runtime import Pipeline
from twobp.runtime.errors import PipelineConfigError
from twobp.sim import CostModel

STEPS = 3
LINKS = {
    # The same pipeline transfers (a boundary costs as much as an F); only the speed of the
    # tensor-parallel all-reduces differs: free, or ten F each.
    "fast": math.inf,
    "slow": 1e5,
}


def link_costs(link: str) -> CostModel:
    """A cost model of the whole model as one stage whose tensor-parallel collectives are
    as fast as ``link`` says."""
    return CostModel.uniform(
        1, 4.0, 4.0, 4.0, send_bytes=1e6, bandwidth=1e6, reduce_bandwidth=LINKS[link]
    )


def chosen_and_parity(link: str | None, sizes: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """A LLaMA pipeline of ``schedule="auto"`` over ``sizes`` (with the cost model of
    ``link``, or measured on an example input where None): what it chose, and the largest
    difference from one process on the whole model over :data:`STEPS` AdamW steps
    (loss, every parameter joined over its shards), in float64."""
    spec, plan = _llama("whole")
    whole = nn.Sequential(*copy.deepcopy(spec.blocks))
    inputs, _ = spec.make_batch(8, 0)
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        "auto",
        n_microbatches=4,
        tensor_parallel=sizes,
        tensor_parallel_plan=plan,
        costs=None if link is None else link_costs(link),
        example_input=inputs[:2] if link is None else None,
        timeout=120,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    names = dict(whole.named_parameters())
    loss_error = 0.0
    for step in range(STEPS):
        inputs, targets = spec.make_batch(8, step)
        pipe.zero_grad()
        loss = pipe.step(inputs, targets)
        reference.zero_grad()
        expected = spec.loss_fn(whole(inputs), targets)
        expected.backward()
        loss_error = max(loss_error, abs(loss - float(expected.detach())))
        optimizer.step()
        reference.step()
    parameters = 0.0
    for name, param in pipe.named_parameters():
        joined = _whole(pipe, param.detach(), param)
        parameters = max(parameters, float((joined - names[name].detach()).abs().max()))
    assert pipe.plan is not None
    return {
        "tp_size": pipe.tp_size,
        "tp_rank": pipe.tp_rank,
        "plan_size": pipe.plan.tensor_parallel,
        "steps": {t.size: t.step for t in pipe.plan.tensor_sizes},
        "schedule": pipe.schedule.name,
        "partition": [len(r) for r in pipe.stage_blocks],
        "pipeline_ranks": pipe.schedule.n_ranks,
        "summary": pipe.plan.summary(),
        "loss": loss_error,
        "parameters": parameters,
    }


def refusal(sizes: tuple[int, ...], n_heads: int = 4) -> str:
    """The error of a pipeline over ``sizes`` that cannot run, on this rank."""
    spec, plan = _llama("whole", n_heads=n_heads)
    try:
        Pipeline(
            spec.blocks,
            spec.loss_fn,
            "auto",
            n_microbatches=4,
            tensor_parallel=sizes,
            tensor_parallel_plan=plan,
            costs=link_costs("fast"),
            timeout=60,
        )
    except PipelineConfigError as exc:
        return str(exc)
    return "built"
