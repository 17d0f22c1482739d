"""Functions the runtime tests run on every rank of a launched group.

Process start-up costs seconds, so one launch runs many configurations and
returns everything the parent compares with its single-process reference.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline


@dataclass(frozen=True)
class Case:
    """One pipeline configuration to train for a few steps."""

    model: str
    schedule: str
    two_bp: bool
    partition: tuple[int, ...] | None = None
    policy: str = "paper"
    weight_group_size: int | None = None

    def __str__(self) -> str:
        parts = "uniform" if self.partition is None else "-".join(map(str, self.partition))
        extra = f" policy={self.policy}" if self.policy != "paper" else ""
        if self.weight_group_size is not None:
            extra += f" group={self.weight_group_size}"
        return f"{self.model} {self.schedule} two_bp={self.two_bp} partition={parts}{extra}"


def _needed(pipe: Pipeline, inputs: Any, targets: Any) -> tuple[Any, Any]:
    """Pass a batch only to the rank that needs it, as a user may."""
    first, last = 0, pipe.schedule.n_stages - 1
    return (inputs if first in pipe.stages else None, targets if last in pipe.stages else None)


def _pipeline(case: Case, n_mb: int, timeout: float) -> Pipeline:
    return Pipeline(
        build_blocks(case.model),
        loss_fn(case.model),
        schedule=case.schedule,
        n_microbatches=n_mb,
        two_bp=case.two_bp,
        partition=None if case.partition is None else list(case.partition),
        two_bp_policy=case.policy,
        weight_group_size=case.weight_group_size,
        device="cpu",
        timeout=timeout,
    )


def train_case(case: Case, n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """Train ``case`` for a few AdamW steps; this rank's losses, first gradients, final state."""
    pipe = _pipeline(case, n_mb, timeout)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(N_STEPS):
        inputs, targets = make_batch(case.model, step, batch_size)
        losses.append(pipe.step(*_needed(pipe, inputs, targets)))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        optimizer.step()
        pipe.zero_grad()
    return {
        "losses": losses,
        "grads": grads,
        "state": pipe.state_dict(),
        "schedule": pipe.schedule.name,
        "stages": sorted(pipe.stages),
    }


def train_cases(cases: list[Case], n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """:func:`train_case` for every case; keyed by ``str(case)``."""
    return {str(c): train_case(c, n_mb, batch_size, timeout) for c in cases}


def utilities(n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """Clip-grad-norm, evaluation, timeline and state-dict loading on this rank."""
    out: dict[str, Any] = {}
    pipe = _pipeline(Case("transformer", "1f1b", True), n_mb, timeout)
    inputs, targets = make_batch("transformer", 0, batch_size)
    pipe.step(*_needed(pipe, inputs, targets))
    out["norm2"] = float(pipe.clip_grad_norm_(0.05))
    out["clipped2"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    out["norm_inf"] = float(pipe.clip_grad_norm_(0.001, norm_type=float("inf")))
    out["clipped_inf"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    out["spans"] = pipe.timeline()
    out["eval_loss"] = pipe.eval_step(*_needed(pipe, inputs, targets))
    out["eval_output"] = pipe.eval_step(_needed(pipe, inputs, targets)[0])

    conv = _pipeline(Case("conv", "gpipe", False), n_mb, timeout)
    full = nn.Sequential(*build_blocks("conv")).state_dict()
    shifted = {k: v + 1 for k, v in full.items()}
    conv.load_state_dict(shifted)
    out["loaded"] = conv.state_dict()
    return out


def step_twice_changing_shape(n_mb: int, timeout: float) -> None:
    """Two steps with different micro-batch sizes: the second must fail."""
    pipe = _pipeline(Case("transformer", "1f1b", True), n_mb, timeout)
    inputs, targets = make_batch("transformer", 0, 2 * n_mb)
    pipe.step(*_needed(pipe, inputs, targets))
    inputs, targets = make_batch("transformer", 1, 4 * n_mb)
    pipe.step(*_needed(pipe, inputs, targets))


def _dies_on_rank_1(logits: Tensor, targets: Tensor) -> Tensor:
    """A loss that kills its process in the middle of a step."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def rank_killed_mid_step(n_mb: int, timeout: float) -> None:
    """Rank 1 (last stage) is killed during its first loss; rank 0 must not hang."""
    pipe = Pipeline(
        build_blocks("mlp"),
        _dies_on_rank_1,
        schedule="1f1b",
        n_microbatches=n_mb,
        device="cpu",
        timeout=timeout,
    )
    inputs, targets = make_batch("mlp", 0, 2 * n_mb)
    pipe.step(*_needed(pipe, inputs, targets))


def placed_by_costs(costs_file: str, n_mb: int, batch_size: int) -> dict[str, Any]:
    """The schedules of pipelines whose W is placed by a cost model (given, and from a file)."""
    costs = {"F": 3.0, "I": 1.0, "W": 0.2}
    out: dict[str, Any] = {}
    for label, given in (("mapping", costs), ("file", costs_file)):
        pipe = Pipeline(
            build_blocks("mlp"), loss_fn("mlp"), "1f1b", n_mb, costs=given, device="cpu"
        )
        inputs, targets = make_batch("mlp", 0, batch_size)
        out[label] = {
            "schedule": str(pipe.schedule),
            "lowered": str(pipe.lowered_schedule),
            "loss": pipe.step(*_needed(pipe, inputs, targets)),
        }
    return out
