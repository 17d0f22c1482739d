"""Functions the runtime tests run on every rank of a launched group.

Process start-up costs seconds, so one launch runs many configurations and
returns everything the parent compares with its single-process reference.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline
from twobp.schedule import Schedule, apply_two_bp, generate
from twobp.schedule.lowering import split_stages


@dataclass(frozen=True)
class Case:
    """One pipeline configuration to train for a few steps."""

    model: str
    schedule: str
    two_bp: bool | tuple[bool, ...]  # one per stage of the model: those split
    partition: tuple[int, ...] | None = None
    policy: str = "paper"
    weight_group_size: int | None = None
    n_microbatches: int | None = None  # None: the launch's count
    placed: bool = False  # a natively split schedule with its W placed again by the policy

    def __str__(self) -> str:
        parts = "uniform" if self.partition is None else "-".join(map(str, self.partition))
        extra = f" policy={self.policy}" if self.policy != "paper" or self.placed else ""
        if self.placed:
            extra += " placed"
        if self.weight_group_size is not None:
            extra += f" group={self.weight_group_size}"
        if self.n_microbatches is not None:
            extra += f" m={self.n_microbatches}"
        return f"{self.model} {self.schedule} two_bp={self.two_bp} partition={parts}{extra}"


def needed_batches(pipe: Pipeline, inputs: Any, targets: Any) -> tuple[Any, Any]:
    """Pass a batch only to the rank that needs it, as a user may."""
    return (inputs if pipe.needs_inputs else None, targets if pipe.needs_targets else None)


def _pipeline(case: Case, n_mb: int, timeout: float, **options: Any) -> Pipeline:
    n_mb = case.n_microbatches or n_mb
    schedule: str | Schedule = case.schedule
    if case.placed:
        generated = generate(case.schedule, dist.get_world_size(), n_mb)
        schedule = apply_two_bp(generated, case.policy)
    return Pipeline(
        build_blocks(case.model),
        loss_fn(case.model),
        schedule=schedule,
        n_microbatches=n_mb,
        two_bp=case.two_bp,
        partition=None if case.partition is None else list(case.partition),
        two_bp_policy=case.policy,
        weight_group_size=case.weight_group_size,
        device="cpu",
        timeout=timeout,
        **options,
    )


def train_case(
    case: Case, n_mb: int, batch_size: int, timeout: float, **options: Any
) -> dict[str, Any]:
    """Train ``case`` for a few AdamW steps; this rank's losses, first gradients, final state.
    ``options`` go to the pipeline as they are."""
    pipe = _pipeline(case, n_mb, timeout, **options)
    losses, grads = train_steps(pipe, case.model, batch_size)
    return {
        "losses": losses,
        "grads": grads,
        "state": pipe.state_dict(),
        "schedule": pipe.schedule.name,
        "stages": sorted(pipe.stages),
        "split": sorted(split_stages(pipe.schedule)),
    }


def train_steps(
    pipe: Pipeline, model: str, batch_size: int, every_rank: bool = False
) -> tuple[list[float], dict[str, Tensor]]:
    """:data:`N_STEPS` AdamW steps of ``pipe`` on ``model``'s batches: the losses, and the
    gradients of the first step (what the tests compare with one process). ``every_rank``
    passes the whole batch to every rank (a pipeline that plans at its first step)."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(N_STEPS):
        inputs, targets = make_batch(model, step, batch_size)
        given = (inputs, targets) if every_rank else needed_batches(pipe, inputs, targets)
        losses.append(pipe.step(*given))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
        optimizer.step()
        pipe.zero_grad()
    return losses, grads


def train_cases(
    cases: list[Case], n_mb: int, batch_size: int, timeout: float, **options: Any
) -> dict[str, Any]:
    """:func:`train_case` for every case; keyed by ``str(case)``."""
    return {str(c): train_case(c, n_mb, batch_size, timeout, **options) for c in cases}


class WeightProducts(TorchDispatchMode):
    """The rows each weight-gradient product contracts, of the linear layers of a model.

    A product whose result has the shape of a linear weight (out x in) and
    whose operands are out x rows and rows x in is that weight's gradient over
    ``rows`` rows: the micro-batches a W concatenated. Forward and input-gradient
    products have the micro-batch's rows as their first dimension instead.
    """

    def __init__(self, weight_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self._shapes = weight_shapes
        self.rows: list[int] = []
        self.dtypes: list[torch.dtype] = []
        """The dtype of each product, as ``rows``."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__.rstrip("_") in ("mm", "addmm"):
            left, right = args[-2:]
            if tuple(out.shape) in self._shapes and left.shape[1] == right.shape[0]:
                self.rows.append(int(left.shape[1]))
                self.dtypes.append(out.dtype)
        return out


def weight_groups(n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """The rows of every weight-gradient product of 1F1B with 2BP, by weight_group_size.

    The MLP's micro-batches have 2 rows; its linear weights are 8 x 8 and 4 x 8.
    """
    out: dict[str, Any] = {}
    inputs, targets = make_batch("mlp", 0, batch_size)
    for group in (None, 2):
        pipe = _pipeline(Case("mlp", "1f1b", True, weight_group_size=group), n_mb, timeout)
        shapes = {tuple(p.shape) for n, p in pipe.named_parameters() if n.endswith("weight")}
        with WeightProducts(shapes) as products:
            pipe.step(*needed_batches(pipe, inputs, targets))
        out[str(group)] = {
            "rows": products.rows,
            "schedule": [str(a) for a in pipe.schedule.actions[pipe.pp_rank]],
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
        }
    return out


def utilities(n_mb: int, batch_size: int, timeout: float) -> dict[str, Any]:
    """Clip-grad-norm, evaluation, timeline, state-dict loading and threads on this rank."""
    out: dict[str, Any] = {}
    pipe = _pipeline(Case("transformer", "1f1b", True), n_mb, timeout)
    inputs, targets = make_batch("transformer", 0, batch_size)
    pipe.step(*needed_batches(pipe, inputs, targets))
    out["schedule"] = {r: [str(a) for a in acts] for r, acts in pipe.schedule.actions.items()}
    out["lowered compute"] = {
        r: [str(a) for a in acts if a.kind.is_compute]
        for r, acts in pipe.lowered_schedule.actions.items()
    }
    out["norm2"] = float(pipe.clip_grad_norm_(0.05))
    out["clipped2"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    out["norm_inf"] = float(pipe.clip_grad_norm_(0.001, norm_type=float("inf")))
    out["clipped_inf"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    out["spans"] = pipe.timeline()
    out["step times"] = pipe.step_times
    out["local spans"] = pipe.local_spans
    out["eval_loss"] = pipe.eval_step(*needed_batches(pipe, inputs, targets))
    out["eval_output"] = pipe.eval_step(needed_batches(pipe, inputs, targets)[0])

    conv = _pipeline(Case("conv", "gpipe", False), n_mb, timeout)
    full = nn.Sequential(*build_blocks("conv")).state_dict()
    shifted = {k: v + 1 for k, v in full.items()}
    conv.load_state_dict(shifted)
    out["loaded"] = conv.state_dict()
    out["weight groups"] = weight_groups(n_mb, batch_size, timeout)
    out["pipeline threads"] = _default_pipeline_threads(n_mb, timeout)
    return out


def _default_pipeline_threads(n_mb: int, timeout: float) -> tuple[int, int]:
    """(cores of this process, intra-op threads a pipeline built with the defaults leaves)."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cores is not None
    omp = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        torch.set_num_threads(cores + 2)  # more than a fair share: the default lowers it
        _pipeline(Case("mlp", "gpipe", False), n_mb, timeout)
        return cores, torch.get_num_threads()
    finally:
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp
        torch.set_num_threads(before)


def _dies(logits: Tensor, targets: Tensor) -> Tensor:
    """A loss that kills its process."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def rank_killed_mid_step(n_mb: int, timeout: float) -> None:
    """Rank 1 (last stage) is killed during its first loss; rank 0 must not hang."""
    pipe = Pipeline(
        build_blocks("mlp"),
        _dies,
        schedule="1f1b",
        n_microbatches=n_mb,
        device="cpu",
        timeout=timeout,
    )
    inputs, targets = make_batch("mlp", 0, 2 * n_mb)
    pipe.step(*needed_batches(pipe, inputs, targets))


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
            "loss": pipe.step(*needed_batches(pipe, inputs, targets)),
        }
    return out


def checkpoint_onto_more_ranks(folder: str, n_mb: int, batch_size: int, timeout: float) -> Any:
    """Ranks 0 and 1 train the conv model, save and go on; then all ranks load and go on.

    Returns, on ranks 0 and 1, the losses and state of the 2-rank pipeline's
    continuation; on every rank, those of the pipeline that loaded the 2-rank
    checkpoint, what ``load`` returned and the step it resumed at.
    """
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    pair = dist.new_group([0, 1])  # every rank takes part in making a group
    if rank < 2:
        two = _pipeline(Case("conv", "1f1b", True), n_mb, timeout, group=pair)
        optimizer = torch.optim.AdamW(two.parameters(), lr=LR)
        _train(two, optimizer, "conv", range(2), batch_size)
        two.save(Path(folder) / "two-ranks", optimizer, extra={"rank": rank})
        out["continued losses"] = _train(two, optimizer, "conv", range(2, 4), batch_size)
        out["continued state"] = two.state_dict()
    dist.barrier()
    every = _pipeline(Case("conv", "1f1b", True), n_mb, timeout)
    optimizer = torch.optim.AdamW(every.parameters(), lr=0.5)  # the checkpoint's lr wins
    out["extra"] = every.load(Path(folder) / "two-ranks", optimizer)
    out["step count"] = every.step_count
    out["stages"] = sorted(every.stages)
    out["loaded losses"] = _train(every, optimizer, "conv", range(2, 4), batch_size)
    out["loaded state"] = every.state_dict()
    return out


def _train(
    pipe: Pipeline, optimizer: torch.optim.Optimizer, model: str, steps: range, batch_size: int
) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = make_batch(model, step, batch_size)
        losses.append(pipe.step(*needed_batches(pipe, inputs, targets)))
        optimizer.step()
        pipe.zero_grad()
    return losses
