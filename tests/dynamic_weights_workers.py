"""Functions the dynamic-W tests run on every rank of a launched group.

Each case trains a pipeline for a few AdamW steps with ``two_bp_policy="dynamic"``
(or a static policy, to compare with) and returns its losses, first-step
gradients, final state and what ``Pipeline.step_times`` counted.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from runtime_workers import needed_batches
from twobp.runtime import Pipeline
from twobp.runtime.execution import dynamic_weights
from twobp.schedule import Kind, apply_two_bp, generate


@dataclass(frozen=True)
class DynamicCase:
    """One pipeline configuration."""

    model: str
    schedule: str
    policy: str = "dynamic"
    data_parallel: int = 1
    recompute: str | None = None
    rows: tuple[int, ...] = ()
    """Batch rows of each step (changing shapes); empty: every step the launch's batch."""
    n_microbatches: int | None = None
    stash_limit: int | None = None
    """Pass the schedule split by ``apply_two_bp(..., memory_limit=stash_limit)``."""

    def __str__(self) -> str:
        extra = f" dp={self.data_parallel}" if self.data_parallel > 1 else ""
        extra += f" recompute={self.recompute}" if self.recompute else ""
        extra += f" rows={'-'.join(map(str, self.rows))}" if self.rows else ""
        extra += f" m={self.n_microbatches}" if self.n_microbatches else ""
        extra += f" stash<={self.stash_limit}" if self.stash_limit else ""
        return f"{self.model} {self.schedule} {self.policy}{extra}"


def rows_of(case: DynamicCase, batch_size: int) -> list[int]:
    """The batch rows of each of the :data:`N_STEPS` steps."""
    return list(case.rows) if case.rows else [batch_size] * N_STEPS


def train(case: DynamicCase, n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """:data:`N_STEPS` AdamW steps of ``case``: losses, first-step gradients, final state
    and the step times' counts summed over the steps."""
    schedule: Any = case.schedule
    if case.stash_limit is not None:
        world = dist.get_world_size() // case.data_parallel
        generated = generate(case.schedule, world, case.n_microbatches or n_mb)
        schedule = apply_two_bp(generated, case.policy, memory_limit=case.stash_limit)
    pipe = Pipeline(
        build_blocks(case.model),
        loss_fn(case.model),
        schedule=schedule,
        n_microbatches=case.n_microbatches or n_mb,
        two_bp=True,
        two_bp_policy=case.policy,
        data_parallel=case.data_parallel,
        recompute=case.recompute,
        timeout=timeout,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, grads, counts = [], {}, {}
    for step, rows in enumerate(rows_of(case, batch_size)):
        inputs, targets = make_batch(case.model, step, rows)
        if case.data_parallel > 1:
            part = rows // case.data_parallel
            start = pipe.dp_rank * part
            inputs, targets = _rows(inputs, start, part), _rows(targets, start, part)
        losses.append(pipe.step(*needed_batches(pipe, inputs, targets)))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        for name, value in dataclasses.asdict(pipe.step_times).items():
            counts[name] = counts.get(name, 0) + value
        optimizer.step()
        pipe.zero_grad()
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    schedule = pipe.schedule.name
    forced = any(_w_before_an_i(acts) for acts in pipe.schedule.actions.values())
    pipe.close()
    return {
        "w listed before an I": forced,
        "losses": losses,
        "grads": grads,
        "state": state,
        "counts": counts,
        "schedule": schedule,
    }


def _w_before_an_i(actions: Any) -> bool:
    kinds = [a.kind for a in actions]
    if Kind.BACKWARD_INPUT not in kinds or Kind.BACKWARD_WEIGHT not in kinds:
        return False
    last_i = max(i for i, k in enumerate(kinds) if k is Kind.BACKWARD_INPUT)
    return Kind.BACKWARD_WEIGHT in kinds[:last_i]


def _rows(batch: Any, start: int, count: int) -> Any:
    if isinstance(batch, tuple):
        return tuple(t[start : start + count] for t in batch)
    return batch[start : start + count]


def session(cases: list[DynamicCase], n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """:func:`train` for every case; keyed by ``str(case)``."""
    return {str(c): train(c, n_mb, batch_size, timeout) for c in cases}


GATE = "a W ran in a wait"
"""The store key the rank of stage 1 sets once it ran part of a W while waiting."""


class _Gate(torch.autograd.Function):
    """Identity; the backward of the step's second micro-batch first waits for :data:`GATE`."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        _Gate.calls += 1
        if _Gate.calls == 2:
            store = dist.distributed_c10d._get_default_store()
            store.wait([GATE], datetime.timedelta(seconds=60))
        return grad


class Gated(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(_Gate.apply(x))


def gated_wait(policy: str, n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """1F1B on 3 ranks whose last stage holds back the input gradient of micro-batch 1
    until the rank of stage 1 has run part of a W while waiting for it (``dynamic`` does,
    in the wait for that gradient or the activation before it): the step completes only
    if W runs in a wait. Returns the rank's first-step gradients and counts."""
    original = dynamic_weights.WaitFiller.run_part

    def run_part(self: dynamic_weights.WaitFiller) -> Any:
        done = original(self)
        if dist.get_rank() == 1:  # another rank's W in its own wait must not open the gate
            dist.distributed_c10d._get_default_store().set(GATE, "1")
        return done

    dynamic_weights.WaitFiller.run_part = run_part  # type: ignore[method-assign]
    blocks = build_blocks("mlp")
    blocks[-1] = Gated(blocks[-1])
    pipe = Pipeline(
        blocks,
        loss_fn("mlp"),
        schedule="1f1b",
        partition=[3, 4, 3],
        n_microbatches=n_mb,
        two_bp_policy=policy,
        timeout=timeout,
    )
    inputs, targets = make_batch("mlp", 0, batch_size)
    loss = pipe.step(*needed_batches(pipe, inputs, targets))
    grads = {n.replace(".inner.", "."): p.grad.clone() for n, p in pipe.named_parameters()}
    counts = dataclasses.asdict(pipe.step_times)
    pipe.close()
    return {"loss": loss, "grads": grads, "counts": counts}


def auto_dynamic(n_mb: int, batch_size: int) -> dict[str, Any]:
    """``schedule="auto"`` with ``two_bp_policy="dynamic"``: what it chose and ranked, and
    one step's gradients."""
    inputs, targets = make_batch("mlp", 0, batch_size)
    pipe = Pipeline(
        build_blocks("mlp"),
        loss_fn("mlp"),
        schedule="auto",
        n_microbatches=n_mb,
        example_input=inputs[: batch_size // n_mb],
        two_bp_policy="dynamic",
        auto_trials=1,
        timeout=60.0,
    )
    pipe.step(*needed_batches(pipe, inputs, targets))
    assert pipe.plan is not None
    out = {
        "choice": pipe.plan.choice,
        "ranked": {c.policy for c in pipe.plan.ranking},
        "schedule": pipe.schedule.name,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None},
    }
    pipe.close()
    return out
