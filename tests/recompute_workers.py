"""Functions the recompute tests run on every rank of a launched group.

One launch trains many configurations and returns what the parent compares:
with the single-process reference (models without randomness), with the same
pipeline without recomputation (a model with dropout), and the memory figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime_models import build_blocks, loss_fn, make_batch
from runtime_workers import needed_batches, train_steps
from twobp.runtime import Pipeline
from twobp.schedule.rebuild import rebuilt_microbatches
from twobp.sim import CostModel, simulate

Mode = Any  # None, a mode name, or a list of them


@dataclass(frozen=True)
class RecomputeCase:
    """One pipeline configuration with a recompute mode."""

    model: str
    schedule: str
    recompute: Mode
    two_bp: bool = True
    weight_group_size: int | None = None
    memory_limit: float | None = None
    """With ``recompute="auto"``: the limit, in the units of :func:`unit_costs`."""
    profiled: bool = False
    """With ``recompute="auto"``: plan on the blocks profiled at the first step instead,
    under a limit that holds every stash (:func:`above_the_peak`)."""

    def __str__(self) -> str:
        group = f" group={self.weight_group_size}" if self.weight_group_size else ""
        limit = f" limit={self.memory_limit}" if self.memory_limit is not None else ""
        limit += " profiled" if self.profiled else ""
        return (
            f"{self.model} {self.schedule} two_bp={self.two_bp} recompute={self.recompute}"
            f"{group}{limit}"
        )


def unit_costs(n_stages: int = 2) -> CostModel:
    """Unit times; a stash and a micro-batch's activations 1 each, what crosses a
    boundary 0.25 (so a rebuilt stash keeps 0.5): a limit in these units picks the
    stashes ``recompute="auto"`` rebuilds, the same on every machine."""
    return CostModel.uniform(n_stages, send_bytes=0.25)


WIDTH = 32
MODES = ("activations", "derivatives", "all")


def dropout_blocks(n_blocks: int = 6, width: int = WIDTH, hidden: int = 4) -> list[nn.Module]:
    """MLP blocks with dropout (float64, from a fixed seed), and a linear head."""
    torch.manual_seed(99)
    blocks: list[nn.Module] = [
        nn.Sequential(
            nn.Linear(width, hidden * width),
            nn.GELU(),
            nn.Dropout(0.25),
            nn.Linear(hidden * width, width),
            nn.LayerNorm(width),
        )
        for _ in range(n_blocks - 1)
    ]
    blocks.append(nn.Linear(width, 4))
    return [b.double() for b in blocks]


def dropout_batch(batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch_size, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.randn(batch_size, 4, generator=gen, dtype=torch.float64)


def above_the_peak(case: RecomputeCase, n_mb: int, example: Tensor) -> float:
    """Bytes per rank half as much again as the simulated peak of ``case``'s schedule with
    2BP on the profiled blocks: a limit that holds every stash, whatever the profile at
    the pipeline's first step measures. (Under a limit that forces rebuilds, where the
    measured costs place W and the rebuilds moves the peak from one profile to the next,
    so which stashes are rebuilt is checked on unit costs.)"""
    probe = Pipeline(
        build_blocks(case.model),
        loss_fn(case.model),
        case.schedule,
        n_mb,
        two_bp=True,
        costs="profile",
        example_input=example,
        device="cpu",
        timeout=30.0,
    )
    assert probe.plan is not None
    costs, schedule = probe.plan.costs, probe.plan.schedule
    probe.close()
    return 1.5 * max(simulate(schedule, costs).peak_memory)


def _pipeline(blocks: list[nn.Module], loss: Any, case: RecomputeCase, n_mb: int) -> Pipeline:
    # recompute="auto" plans on unit costs: which stashes are rebuilt is fixed by the limit.
    planned = {} if case.memory_limit is None or case.profiled else {"costs": unit_costs()}
    return Pipeline(
        blocks,
        loss,
        schedule=case.schedule,
        n_microbatches=n_mb,
        two_bp=case.two_bp,
        recompute=case.recompute,
        weight_group_size=case.weight_group_size,
        memory_limit=case.memory_limit,
        device="cpu",
        timeout=30.0,
        **planned,
    )


def train(case: RecomputeCase, n_mb: int, batch_size: int) -> dict[str, Any]:
    """Train a reference model for a few AdamW steps; losses, first gradients, final state.

    A profiled case plans at its first step (no example input, no cost model), so
    every rank is given the whole batch, which it plans on."""
    if case.profiled:
        inputs = make_batch(case.model, 0, batch_size)[0]
        limit = above_the_peak(case, n_mb, inputs[: batch_size // n_mb])
        case = replace(case, memory_limit=limit)
    pipe = _pipeline(build_blocks(case.model), loss_fn(case.model), case, n_mb)
    losses, grads = train_steps(pipe, case.model, batch_size, every_rank=case.profiled)
    out = {"losses": losses, "grads": grads, "state": pipe.state_dict()}
    out["rebuilt"] = rebuilt_microbatches(pipe.schedule)
    out["schedule"] = str(pipe.schedule)
    pipe.close()
    return out


def dropout_step(case: RecomputeCase, n_mb: int, batch_size: int) -> dict[str, Any]:
    """Two steps of the dropout MLP from a fixed seed: losses, gradients, memory figures."""
    pipe = _pipeline(dropout_blocks(), F.mse_loss, case, n_mb)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    inputs, targets = dropout_batch(batch_size)
    torch.manual_seed(1000 + pipe.rank)
    losses = []
    for _ in range(2):
        pipe.zero_grad()
        losses.append(pipe.step(*needed_batches(pipe, inputs, targets)))
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        if len(losses) == 1:
            optimizer.step()
    out = {
        "losses": losses,
        "grads": grads,
        "memory": pipe.memory_stats(optimizer),
        "after": float(torch.rand(()).item()),  # the generator goes on as without recompute
        "rebuilt": rebuilt_microbatches(pipe.schedule),
    }
    pipe.close()
    return out


def session(
    trained: list[RecomputeCase], dropout: list[RecomputeCase], n_mb: int, dropout_mb: int
) -> dict[str, Any]:
    """Every case of the parent's lists on this rank, keyed by ``str(case)``.

    The trained cases and the non-repeatable forward run ``n_mb`` micro-batches
    of 2 samples, the dropout cases ``dropout_mb``.
    """
    torch.set_num_threads(1)
    return {
        "trained": {str(c): train(c, n_mb, 2 * n_mb) for c in trained},
        "dropout": {str(c): dropout_step(c, dropout_mb, 2 * dropout_mb) for c in dropout},
        "non-repeatable": {m: non_repeatable(n_mb, 2 * n_mb, m) for m in MODES},
    }


def non_repeatable(n_mb: int, batch_size: int, mode: str) -> tuple[str, str]:
    """The conv model (BatchNorm in training mode) with recompute: this rank's error."""
    case = RecomputeCase("conv", "1f1b", mode)
    pipe = _pipeline(build_blocks("conv"), loss_fn("conv"), case, n_mb)
    inputs, targets = make_batch("conv", 0, batch_size)
    try:
        pipe.step(*needed_batches(pipe, inputs, targets))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        pipe.close()
    return "", ""


def kept_when_it_fits(n_mb: int, batch_size: int) -> dict[str, Any]:
    """recompute="auto" under a limit the default fits (1 GiB), two_bp unset and an example
    input given: what it runs beside a pipeline built without recompute="auto", then
    :func:`train_steps` of it (the parent compares them with one process).

    The pipeline without it is given the stages the first chose to split: a second
    profile, on a busy machine, may choose others."""
    torch.set_num_threads(1)
    example = make_batch("mlp", 0, batch_size)[0][: batch_size // n_mb]
    common: dict[str, Any] = {"example_input": example, "device": "cpu", "timeout": 30.0}
    auto = Pipeline(
        build_blocks("mlp"),
        loss_fn("mlp"),
        "1f1b",
        n_mb,
        recompute="auto",
        memory_limit="1GiB",
        **common,
    )
    choice = auto.two_bp_choice
    plain = Pipeline(
        build_blocks("mlp"),
        loss_fn("mlp"),
        "1f1b",
        n_mb,
        two_bp=None if choice is None else list(choice.split),
        **common,
    )
    out: dict[str, Any] = {
        "two_bp_choice": choice,
        "rebuild_choice": auto.rebuild_choice,
        "auto_plan": None if auto.plan is None else auto.plan.summary(),
    }
    for name in ("schedule", "recompute", "stage_blocks"):
        out[name] = (getattr(auto, name), getattr(plain, name))
    plain.close()
    out["losses"], out["grads"] = train_steps(auto, "mlp", batch_size)
    out["state"] = auto.state_dict()
    auto.close()
    return out
