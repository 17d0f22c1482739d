"""Steps that fail on one rank while every rank lives on (run by ``test_runtime_step_failure``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime_models import build_blocks, loss_fn, make_batch
from runtime_workers import needed_batches
from twobp.runtime import Pipeline

N_MB = 4
BATCH = 2 * N_MB


class Trap(nn.Module):
    """A block that fails, on purpose, while armed: by raising or by changing its dtype."""

    def __init__(self, block: nn.Module, how: str) -> None:
        super().__init__()
        self.block = block
        self.how = how
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        if self.armed and self.how == "block":
            raise RuntimeError("block failed on purpose")
        if self.armed and self.how == "shape":
            return out.float()
        return out


class TrapLoss:
    """The model's loss, but a vector while armed (as a mistaken loss function would)."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, out: Tensor, y: Tensor) -> Tensor:
        if self.armed:
            return (out - y) ** 2
        return loss_fn("mlp")(out, y)


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def failing_steps(
    cases: list[tuple[str, int, bool]], timeout: float, schedule: str = "1f1b", **options: Any
) -> dict[str, Any]:
    """For each (how, block index, fail on the first step): a failed step, then a good one.

    ``how`` is ``block`` (a block raises), ``shape`` (a block changes its
    dtype after the first step) or ``loss`` (the loss is not a scalar). The
    failing rank catches its error and goes on, as a training loop that skips
    a bad batch would; the next step of the same pipeline must equal one
    process's. ``options`` go to the pipeline as they are.
    """
    out: dict[str, Any] = {}
    x, y = make_batch("mlp", 0, BATCH)
    for how, index, first_step in cases:
        blocks = build_blocks("mlp")
        trap = Trap(blocks[index], how)
        blocks[index] = trap
        loss = TrapLoss()
        pipe = Pipeline(blocks, loss, schedule, N_MB, device="cpu", timeout=timeout, **options)
        if not first_step:
            pipe.step(*needed_batches(pipe, x, y))
            pipe.zero_grad()
        trap.armed = how in ("block", "shape")
        loss.armed = how == "loss"
        key = f"{how} {index} {'first' if first_step else 'later'}"
        out[key] = _fail_then_step(pipe, trap, loss, index, needed_batches(pipe, x, y))
    return out


def failing_steps_cut_uniformly(
    cases: list[tuple[str, int, bool]], timeout: float, schedule: str
) -> dict[str, Any]:
    """:func:`failing_steps` on the uniform partition (a V would otherwise balance at its
    first step, where the failure would be met while profiling)."""
    return failing_steps(cases, timeout, schedule, partition="uniform")


def _fail_then_step(
    pipe: Pipeline, trap: Trap, loss: TrapLoss, index: int, batch: tuple[Any, Any]
) -> dict[str, Any]:
    """A step with the trap as armed, then one disarmed: what each did."""
    failed = _outcome(lambda: pipe.step(*batch))
    grads_after_failure = [p.grad for p in pipe.parameters()]
    trap.armed = loss.armed = False
    value = pipe.step(*batch)
    return {
        "failed": failed,
        "grads dropped": all(g is None for g in grads_after_failure),
        "loss": value,
        # Named as in the plain model: the trap adds ".block" to its block's names.
        "grads": {
            n.replace(f"{index}.block.", f"{index}.", 1): p.grad.clone()
            for n, p in pipe.named_parameters()
        },
    }


def failure_then_other_work(folder: str, timeout: float) -> dict[str, Any]:
    """The failing rank catches its error and saves, or builds another pipeline."""
    rank = dist.get_rank()
    x, y = make_batch("mlp", 0, BATCH)
    blocks = build_blocks("mlp")
    trap = Trap(blocks[9], "block")
    blocks[9] = trap
    pipe = Pipeline(blocks, loss_fn("mlp"), "1f1b", N_MB, device="cpu", timeout=timeout)
    trap.armed = True
    out: dict[str, Any] = {"failed": _outcome(lambda: pipe.step(*needed_batches(pipe, x, y)))}
    trap.armed = False
    pipe.save(folder)
    other = Pipeline(build_blocks("mlp"), loss_fn("mlp"), "gpipe", N_MB, device="cpu")
    out["other loss"] = other.step(*needed_batches(other, x, y))
    out["rank"] = rank
    return out


class MovesBadly(nn.Linear):
    """A block that cannot be moved to its device on one rank."""

    def __init__(self, failing_rank: int) -> None:
        super().__init__(8, 8, dtype=torch.float64)
        self.failing_rank = failing_rank

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        if dist.get_rank() == self.failing_rank:
            raise RuntimeError("cannot move this block, on purpose")
        return super()._apply(fn, recurse)


def construction_and_save_failures(folder: str, timeout: float) -> dict[str, Any]:
    """A rank that fails to build its stages or to save tells the others; all go on."""
    x, y = make_batch("mlp", 0, BATCH)
    blocks = build_blocks("mlp")
    blocks[8] = MovesBadly(failing_rank=1)
    out: dict[str, Any] = {}
    out["build"] = _outcome(
        lambda: Pipeline(blocks, loss_fn("mlp"), "1f1b", N_MB, device="cpu", timeout=timeout)
    )
    pipe = Pipeline(build_blocks("mlp"), loss_fn("mlp"), "1f1b", N_MB, timeout=timeout)
    pipe.step(*needed_batches(pipe, x, y))
    unpicklable = (lambda: None) if dist.get_rank() == 1 else None
    out["save"] = _outcome(lambda: pipe.save(folder, extra=unpicklable))
    out["saved after"] = str(pipe.save(folder, extra={"fine": True}))
    return out


def failing_replicated_steps(timeout: float) -> dict[str, Any]:
    """Steps of 2 copies of a Chimera pipeline (4 ranks) that fail on one rank of copy 1.

    Every copy passes the same batch, so a step's loss and gradients are those
    of one process on that batch. Then the order that once left a rank waiting
    in a receive: caught configuration errors on one pipeline, then a second
    pipeline on the same group whose loss raises on the last stage.
    """
    rank = dist.get_rank()
    x, y = make_batch("mlp", 0, BATCH)
    out: dict[str, Any] = {}
    for how, index in (("block", 0), ("block", 9), ("loss", 9)):
        blocks = build_blocks("mlp")
        trap = Trap(blocks[index], how)
        blocks[index] = trap
        loss = TrapLoss()
        pipe = Pipeline(
            blocks, loss, "chimera", N_MB, device="cpu", timeout=timeout, data_parallel=2
        )
        trap.armed = how == "block" and rank == 3
        loss.armed = how == "loss" and rank == 3
        out[f"{how} {index}"] = _fail_then_step(pipe, trap, loss, index, (x, y))
    first = Pipeline(build_blocks("mlp"), loss_fn("mlp"), "1f1b", N_MB, device="cpu",
                     timeout=timeout, data_parallel=2)  # fmt: skip
    caught = [
        _outcome(lambda: first.step(None if rank == 0 else x, y)),
        _outcome(lambda: first.step(x[:3], y[:3])),  # fewer rows than micro-batches
    ]
    loss = TrapLoss()
    second = Pipeline(
        build_blocks("mlp"), loss, "1f1b", N_MB, device="cpu", timeout=timeout, data_parallel=2
    )
    loss.armed = rank == 3
    out["second pipeline"] = {
        "caught": [c[0] for c in caught],
        "failed": _outcome(lambda: second.step(x, y)),
    }
    return out


def failing_steps_dynamic(
    cases: list[tuple[str, int, bool]], timeout: float, schedule: str
) -> dict[str, Any]:
    """:func:`failing_steps` under ``two_bp_policy="dynamic"``, on the uniform partition."""
    return failing_steps(cases, timeout, schedule, two_bp_policy="dynamic", partition="uniform")
