"""Loss scaling (``twobp.GradScaler``) where one rank alone overflows, and under the schedules
whose stages are replicated, a tied weight and recomputation; real gloo ranks, float16.

One launched session of 4 ranks runs every case; each is compared with
``torch.amp.GradScaler("cpu")`` on one process fed the same global batches under float16
autocast: the scales and skips exactly, the losses, norms and parameters within float16's
tolerance (a gradient that is wrong by a term or a factor is far outside it).

* 2 stages x 2 copies; at one step only copy 1's batch makes a float16 gradient overflow
  (one bias of the first stage, :class:`grad_scaler_cases_workers.Spike`): every rank skips
  that step, keeps its parameters and backs the scale off alike, then the run goes on as
  one process's. With ``pipe.shard_optimizer`` (ZeRO-1) the infinity lands in one rank's
  shard of the reduced gradient only, and still every rank skips.
* the tied model under Chimera, DualPipe with ``recompute="all"``, and 1F1B in 2 copies
  with ``recompute="activations"``, from a scale at which the first step overflows.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grad_scaler_cases_workers import (
    CASE_LR,
    CASE_SCALER,
    CASE_STEPS,
    CONFINED_LR,
    CONFINED_SCALER,
    CONFINED_STEPS,
    HOT_STEP,
    N_MB,
    PART,
    case_batch,
    case_blocks,
    global_batch,
    session,
    spike_blocks,
)
from runtime_models import loss_fn
from twobp.runtime import launch

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CASES = [
    ("chimera", {"n_microbatches": 4}),
    ("dualpipe", {"n_microbatches": 8, "recompute": "all"}),
    ("1f1b", {"n_microbatches": 4, "data_parallel": 2, "recompute": "activations"}),
]
RTOL, ATOL = 2e-3, 2e-4
"""Float16's rounding: the parameters stay within a quarter of this of one process's."""


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch(session, 4, CASES, timeout=600)


def _overflowing(model: nn.Module, x: Tensor, y: Tensor, scale: float) -> list[str]:
    """The parameters whose gradient of ``scale`` times the loss on ``(x, y)`` is not finite."""
    named = dict(model.named_parameters())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss * scale, list(named.values()))
    return [n for (n, _), g in zip(named.items(), grads, strict=True) if not g.isfinite().all()]


def _overflowing_copy(model: nn.Module, x: Tensor, y: Tensor, copy: int, scale: float) -> list[str]:
    """What overflows in copy ``copy``'s micro-batches as a pipeline stage runs them (each
    loss a mean over its micro-batch, started from ``scale / N_MB``)."""
    rows = slice(copy * PART, (copy + 1) * PART)
    found: set[str] = set()
    for x_mb, y_mb in zip(x[rows].chunk(N_MB), y[rows].chunk(N_MB), strict=True):
        found.update(_overflowing(model, x_mb, y_mb, scale / N_MB))
    return sorted(found)


def _confined_reference() -> dict[str, Any]:
    """One process, both copies' batches at once, torch.amp.GradScaler."""
    model = nn.Sequential(*spike_blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFINED_LR)
    scaler = torch.amp.GradScaler("cpu", **CONFINED_SCALER)
    out: dict[str, Any] = {"losses": [], "scales": [], "skipped": []}
    for step in range(CONFINED_STEPS):
        x, y = global_batch(step)
        if step == HOT_STEP:
            out["copies"] = [_overflowing_copy(model, x, y, d, scaler.get_scale()) for d in (0, 1)]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        out["skipped"].append(scaler.get_scale() < before)
        out["scales"].append(scaler.get_scale())
        out["losses"].append(float(loss.detach()))
        optimizer.zero_grad()
    out["state"] = {n: p.detach() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def confined_reference() -> dict[str, Any]:
    return _confined_reference()


def _assert_state_close(runs: list[dict[str, Any]], want: dict[str, Tensor]) -> None:
    state: dict[str, Tensor] = {}
    for run in runs:
        for name, value in run["state"].items():
            if name in state:  # another copy: the same parameters, bit for bit
                assert torch.equal(state[name], value), name
            state[name] = value
    assert state.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _check_confined(runs: list[dict[str, Any]], want: dict[str, Any]) -> None:
    # The premise: copy 1's batch alone overflows, in the spiked bias alone.
    assert want["copies"] == [[], ["0.spiked"]]
    assert want["skipped"] == [step == HOT_STEP for step in range(CONFINED_STEPS)]
    for rank, run in enumerate(runs):
        assert run["error"] == "", f"rank {rank}: {run['error']}"
        assert run["skipped"] == want["skipped"], f"rank {rank}"
        assert run["scales"] == want["scales"], f"rank {rank}"
        assert run["unchanged"], f"rank {rank} changed its parameters at the skipped step"
        assert run["losses"] == pytest.approx(want["losses"], rel=RTOL)
    _assert_state_close(runs, want["state"])


def test_an_overflow_in_one_copy_skips_the_step_on_every_rank(ranks, confined_reference):
    runs = [r["plain"] for r in ranks]
    _check_confined(runs, confined_reference)
    # Copy 1's first stage overflowed; the all-reduce of that stage's gradients carried the
    # infinity to copy 0's; the second stage's ranks saw none and skipped on the agreement.
    hot = [step == HOT_STEP for step in range(CONFINED_STEPS)]
    clean = [False] * CONFINED_STEPS
    assert [run["not_finite"] for run in runs] == [hot, clean, hot, clean]


def test_an_overflow_in_one_optimizer_shard_skips_the_step_on_every_rank(ranks, confined_reference):
    """pipe.shard_optimizer: the reduce-scatter leaves the infinity in one rank's shard."""
    runs = [r["sharded"] for r in ranks]
    _check_confined(runs, confined_reference)
    seen = [rank for rank, run in enumerate(runs) if any(run["not_finite"])]
    assert len(seen) == 1 and seen[0] in (0, 2), seen  # a first-stage rank's shard
    assert runs[seen[0]]["not_finite"] == [step == HOT_STEP for step in range(CONFINED_STEPS)]


def _case_reference(batch_size: int) -> dict[str, Any]:
    """One process, the whole batch, the tied model, torch.amp.GradScaler."""
    model = nn.Sequential(*case_blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=CASE_LR)
    scaler = torch.amp.GradScaler("cpu", **CASE_SCALER)
    out: dict[str, Any] = {"losses": [], "scales": [], "skipped": [], "norms": []}
    for step in range(CASE_STEPS):
        inputs, targets = case_batch(step, batch_size)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn("tied")(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        out["norms"].append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        out["skipped"].append(scaler.get_scale() < before)
        out["scales"].append(scaler.get_scale())
        out["losses"].append(float(loss.detach()))
        optimizer.zero_grad()
    # The head's weight is the embedding's: named once, as the pipeline names it.
    out["state"] = {n: p.detach() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1].get('recompute')}")
def test_replicated_stages_a_tied_weight_and_recompute_match_torch_grad_scaler(ranks, case):
    runs = [r[repr(case)] for r in ranks]
    want = _case_reference(PART * case[1].get("data_parallel", 1))
    # The first step overflows; then the scale grows at every step.
    assert want["skipped"] == [True] + [False] * (CASE_STEPS - 1)
    assert want["scales"] == [2.0 ** (12 + s) for s in range(CASE_STEPS)]
    for rank, run in enumerate(runs):
        assert run["skipped"] == want["skipped"], f"rank {rank}"
        assert run["scales"] == want["scales"], f"rank {rank}"
        assert run["losses"] == pytest.approx(want["losses"], rel=RTOL)
        assert not math.isfinite(run["norms"][0])
        assert run["norms"][1:] == pytest.approx(want["norms"][1:], rel=RTOL)
    _assert_state_close(runs, want["state"])
