"""Functions the ``schedule="auto"`` tests run on every rank of a launched group."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime_models import build_blocks, loss_fn, make_batch
from runtime_workers import needed_batches
from twobp.runtime import Pipeline, PipelineConfigError
from twobp.runtime.base.group import join_world
from twobp.runtime.setup.auto.cost_measurement import (
    allreduce_link,
    allreduce_speed,
    link_speed,
)
from twobp.schedule.action import Kind
from twobp.schedule.lowering import has_reductions, split_stages
from twobp.sim import simulate
from twobp.sim.costs import allreduce_time


def chosen_and_trained(
    model: str, n_mb: int, batch_size: int, schedule: str = "auto", **options: Any
) -> dict[str, Any]:
    """Build a pipeline (``schedule="auto"``), run one step; what it chose and its gradients."""
    inputs, targets = make_batch(model, 0, batch_size)
    example = (
        tuple(t[: batch_size // n_mb] for t in inputs)
        if isinstance(inputs, tuple)
        else (inputs[: batch_size // n_mb])
    )
    pipe = Pipeline(
        build_blocks(model),
        loss_fn(model),
        schedule=schedule,
        n_microbatches=n_mb,
        example_input=example,
        device="cpu",
        timeout=60.0,
        **options,
    )
    loss = pipe.step(*needed_batches(pipe, inputs, targets))
    assert pipe.plan is not None
    return {
        "schedule": str(pipe.schedule),
        "choice": pipe.plan.choice,
        "partition": pipe.plan.partition,
        "send_overhead": pipe.plan.costs.send_overhead,
        "shown": str(pipe.plan),
        "contenders": [c.candidate for c in pipe.plan.contenders],
        "trial_times": pipe.plan.trial_times,
        "loss": loss,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
    }


def refused(model: str, n_mb: int, batch_size: int, **options: Any) -> str:
    """The message of the error ``schedule="auto"`` raises with ``options``."""
    try:
        chosen_and_trained(model, n_mb, batch_size, **options)
    except PipelineConfigError as exc:
        return str(exc)
    return "no error"


def changed_by_planning(model: str, n_mb: int, batch_size: int) -> list[str]:
    """Build a pipeline (``schedule="auto"``) of ``model`` with a dropout in block 4; the
    names of the model's entries it changed, and ``"random state"`` if it changed that."""
    blocks = build_blocks(model)
    blocks[4] = nn.Sequential(blocks[4], nn.Dropout(0.2))  # the trial steps draw masks
    whole = nn.Sequential(*blocks)
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    torch.manual_seed(5)
    random_state = torch.get_rng_state()
    _auto_pipeline(model, n_mb, batch_size, blocks=blocks).close()
    after = whole.state_dict()
    grads = [n for n, p in whole.named_parameters() if p.grad is not None]
    changed = sorted(k for k, v in before.items() if not torch.equal(v, after[k])) + grads
    if not torch.equal(torch.get_rng_state(), random_state):
        changed.append("random state")
    return changed


def link_figures(peers: tuple[int, int], nbytes: int) -> tuple[float, float]:
    """The latency and bandwidth between ``peers`` that this rank learns."""
    world = join_world(torch.device("cpu"), 60.0)
    return link_speed(world, peers, torch.device("cpu"), nbytes)


BANDWIDTH = 3e8
"""Bytes per second of the modelled ring all-reduce (see :func:`allreduce_figures`)."""
LATENCY = 2e-5


def _modelled(world: Any, tensor: torch.Tensor) -> float:
    """A real all-reduce of ``tensor``, timed by the ring model at :data:`BANDWIDTH`."""
    dist.all_reduce(tensor, group=world.group)
    nbytes = tensor.numel() * tensor.element_size()
    return allreduce_time(nbytes, world.size, BANDWIDTH, LATENCY)


def allreduce_figures(nbytes: int, check_bytes: int) -> dict[str, Any]:
    """The all-reduce bandwidth this rank learns for ``nbytes``, measured, and timed by
    the ring model (a clock that cannot be late); with the time the modelled bandwidth
    predicts for ``check_bytes`` and the model's own time for it."""
    world = join_world(torch.device("cpu"), 60.0)
    modelled = allreduce_speed(world, torch.device("cpu"), nbytes, timed=_modelled)
    latency, _ = allreduce_link(world, torch.device("cpu"), nbytes, timed=_modelled)
    return {
        "latency": latency,
        "measured": allreduce_speed(world, torch.device("cpu"), nbytes),
        "modelled": modelled,
        "predicted": allreduce_time(check_bytes, world.size, modelled, 0.0),
        "model": allreduce_time(check_bytes, world.size, BANDWIDTH, 0.0),
    }


def _auto_pipeline(
    model: str,
    n_mb: int,
    batch_size: int,
    *,
    blocks: list[nn.Module] | None = None,
    data_parallel: int | None = None,
) -> Pipeline:
    """A ``schedule="auto"`` pipeline of ``model`` (of ``blocks`` if given, else freshly
    built), planned on one micro-batch of its batch, in ``data_parallel`` copies."""
    inputs, _ = make_batch(model, 0, batch_size)
    return Pipeline(
        build_blocks(model) if blocks is None else blocks,
        loss_fn(model),
        schedule="auto",
        n_microbatches=n_mb,
        example_input=inputs[: batch_size // n_mb],
        device="cpu",
        timeout=60.0,
        data_parallel=data_parallel,
    )


def measured_link(model: str, n_mb: int, batch_size: int, data_parallel: int) -> tuple[float, ...]:
    """The link ``schedule="auto"`` measured: latency, bandwidth and the sender's overhead."""
    with _auto_pipeline(model, n_mb, batch_size, data_parallel=data_parallel) as pipe:
        assert pipe.plan is not None
        costs = pipe.plan.costs
        return costs.send_latency, costs.bandwidth, costs.send_overhead


def plan_with_copies(model: str, n_mb: int, batch_size: int, data_parallel: int) -> tuple:
    """What ``schedule="auto"`` planned for ``data_parallel`` copies: the all-reduce
    bandwidth it measured, whether its schedule reduces, its predicted step time, and
    that of its schedule simulated without the reductions. It runs a step first."""
    inputs, targets = make_batch(model, 0, batch_size)
    with _auto_pipeline(model, n_mb, batch_size, data_parallel=data_parallel) as pipe:
        plan = pipe.plan
        assert plan is not None
        own = slice(pipe.dp_rank * batch_size // 2, (pipe.dp_rank + 1) * batch_size // 2)
        assert math.isfinite(pipe.step(inputs[own], targets[own]))
        reduces = has_reductions(plan.schedule)
        plain = plan.schedule.with_actions(
            {
                rank: [a for a in acts if a.kind is not Kind.REDUCE]
                for rank, acts in plan.schedule.actions.items()
            }
        )
        # As the search simulated it: a fused stage's F without the 2BP engine.
        costs = plan.costs.for_schedule(plain.n_stages).for_split(split_stages(plain))
        bare = simulate(plain, costs).makespan
        return plan.costs.reduce_bandwidth, reduces, plan.predicted_step_time, bare


def refused_on_rank_1(model: str, n_mb: int, batch_size: int, wrong: str) -> str:
    """The error ``schedule="auto"`` raises when only rank 1 gives no example input
    (``wrong="example_input"``), a memory limit that is no amount (``"memory_limit"``)
    or a negative count of trials (``"auto_trials"``)."""
    inputs, _ = make_batch(model, 0, batch_size)
    example = inputs[: batch_size // n_mb]
    limit = None
    trials = 6
    if dist.get_rank() == 1:
        example = None if wrong == "example_input" else example
        limit = "a lot" if wrong == "memory_limit" else None
        trials = -1 if wrong == "auto_trials" else trials
    try:
        Pipeline(
            build_blocks(model),
            loss_fn(model),
            schedule="auto",
            n_microbatches=n_mb,
            example_input=example,
            device="cpu",
            timeout=20.0,
            memory_limit=limit,
            auto_trials=trials,
        )
    except PipelineConfigError as exc:
        return str(exc)
    return "no error"


class StallsInTrialSteps(nn.Module):
    """A block that, on rank 1, never returns from a forward of ``schedule="auto"``'s
    trial steps (and runs as ``inner`` everywhere else)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        if dist.get_rank() == 1 and _inside("trial_times"):
            threading.Event().wait()  # until the launcher ends this process
        return self.inner(x)


def _inside(function: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def stalled_in_trials(model: str, n_mb: int, batch_size: int, timeout: float) -> None:
    """``schedule="auto"`` whose rank 1 stalls in its first trial step."""
    inputs, _ = make_batch(model, 0, batch_size)
    Pipeline(
        [StallsInTrialSteps(b) for b in build_blocks(model)],
        loss_fn(model),
        schedule="auto",
        n_microbatches=n_mb,
        example_input=inputs[: batch_size // n_mb],
        device="cpu",
        timeout=timeout,
    )


def planned_at_first_step(
    model: str, n_mb: int | str, batch_size: int, **options: Any
) -> dict[str, Any]:
    """``schedule="auto"`` without an example input: the optimizer built before the first
    step (on every block's parameters), one step that plans and runs, one optimizer step."""
    inputs, targets = make_batch(model, 0, batch_size)
    pipe = Pipeline(
        build_blocks(model),
        loss_fn(model),
        schedule="auto",
        n_microbatches=n_mb,
        device="cpu",
        timeout=60.0,
        **options,
    )
    before = sum(1 for _ in pipe.parameters())
    planned_early = pipe.plan is not None
    try:
        pipe.timeline()
        refused = "no error"
    except PipelineConfigError as exc:
        refused = str(exc)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = pipe.step(inputs if dist.get_rank() == 0 else None, targets)
    assert pipe.plan is not None
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad()
    second = pipe.step(*needed_batches(pipe, *make_batch(model, 1, batch_size)))
    return {
        "parameters_before": before,
        "parameters_after": sum(1 for _ in pipe.parameters()),
        "planned_early": planned_early,
        "refused_before": refused,
        "n_microbatches": pipe.n_microbatches,
        "choice": pipe.plan.choice,
        "ranking": pipe.plan.ranking,
        "contenders": [c.candidate for c in pipe.plan.contenders],
        "trial_times": pipe.plan.trial_times,
        "shown": str(pipe.plan),
        "schedule": str(pipe.schedule),
        "loss": loss,
        "second": second,
        "grads": grads,
    }


def planned_at_first_step_cases(
    model: str, batch_size: int, cases: list[tuple[int | str, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """:func:`planned_at_first_step` for each ``(n_microbatches, options)``, in one group."""
    return [planned_at_first_step(model, n_mb, batch_size, **options) for n_mb, options in cases]
