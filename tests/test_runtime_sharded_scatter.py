"""Sharded parameters with each stage's gradients reduce-scattered after each of its W.

2 x 2 gloo ranks (2 copies of a 2-rank pipeline), float64, ``shard_parameters=True``
with 2BP and ``scatter_each_w=True`` (and None, the rule): 3 AdamW steps, with and
without gradient accumulation, equal to one process (plain PyTorch) to 1e-10, on 1f1b,
zb-h1, zb-v, interleaved-1f1b and the dynamic policy, with a weight tied within a
stage. Then the peak of activations, stashes, whole gradients and gathered weights
measured after every compute action (and before the end of each W and B),
reduce-scattering after each W against at R: lower by what ``peak_memory`` predicts for
the same schedule (within 15%).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from runtime_models import LR, N_STEPS, loss_fn, make_batch
from sharded_parameters_workers import N_MB, batch_of
from sharded_scatter_workers import blocks, gradient_peaks, train_many
from twobp.partition.profiler import profile_blocks
from twobp.partition.solver import uniform
from twobp.runtime import launch
from twobp.schedule import Schedule
from twobp.sim.from_profile import stage_cost_model
from twobp.sim.recompute import with_recompute
from twobp.sim.simulate import simulate

TOL = 1e-10
CASES: list[tuple[str, str, int, str, bool | None]] = [
    ("1f1b", "eager", 1, "mlp", True),
    ("1f1b", "eager", 2, "mlp", True),
    ("zb-h1", "paper", 1, "mlp", True),
    ("zb-h1", "paper", 2, "tied", None),
    ("zb-v", "paper", 1, "mlp", True),
    ("interleaved-1f1b", "paper", 2, "mlp", True),
    ("1f1b", "dynamic", 1, "mlp", True),
    ("zb-h1", "dynamic", 2, "tied", True),
]
SCHEDULES = [("zb-h1", "paper"), ("interleaved-1f1b", "eager"), ("1f1b", "eager")]
ROWS = 8  # a copy's rows a step: small stashes, so that the whole gradients weigh
pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _reference(model: str, accumulate: int) -> dict[str, Any]:
    net = nn.Sequential(*blocks(model))
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    losses = []
    for step in range(N_STEPS):
        for micro in range(accumulate):
            inputs, targets = batch_of(step, micro, 2)
            loss = loss_fn("mlp")(net(inputs), targets)
            loss.backward()
            losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": net.state_dict()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(train_many, 4, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_scattered_after_each_w_match_one_process(
    results: list[dict[str, Any]], case: tuple[str, str, int, str, bool | None]
) -> None:
    _, _, accumulate, model, _ = case
    reference = _reference(model, accumulate)
    # Some rank reduce-scattered after a W (or B) in every step.
    assert all(any(r[repr(case)]["scattered"][i] for r in results) for i in range(N_STEPS))
    for rank, r in enumerate(results):
        r = r[repr(case)]
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (case, rank, got, want)
        for name, value in r["state"].items():
            torch.testing.assert_close(value, reference["state"][name], rtol=0, atol=TOL)


def predicted(schedule: Schedule) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each rank's simulated peak of activations, stashes, whole gradients and gathered
    weights, reduce-scattering after each W and at R, from the blocks profiled on one
    micro-batch."""
    made = blocks("mlp")
    example, _ = make_batch("mlp", 0, ROWS // N_MB)
    profiled = profile_blocks(made, example, repeats=1, warmup=0)
    costs = stage_cost_model(profiled, uniform(len(made), schedule.n_stages))
    zeros = (0.0,) * costs.n_stages
    costs = replace(
        with_recompute(costs, "activations"),
        parameter_bytes=zeros,
        optimizer_bytes=zeros,
        gathered_bytes=costs.parameter_bytes,
        shard_parameters=True,
    )
    each, at_r = (replace(costs, scatter_each_w=setting) for setting in (True, False))
    return simulate(schedule, each).peak_memory, simulate(schedule, at_r).peak_memory


@pytest.fixture(scope="module")
def peaks() -> list[dict[str, Any]]:
    return launch(gradient_peaks, 4, SCHEDULES, ROWS, timeout=300)


@pytest.mark.parametrize("case", SCHEDULES, ids=" ".join)
def test_scattering_after_each_w_lowers_the_peak_as_the_simulator_predicts(
    peaks: list[dict[str, Any]], case: tuple[str, str]
) -> None:
    name = " ".join(case)
    schedule = peaks[0][name]["schedule"]
    sim_each, sim_at_r = predicted(schedule)
    saved = []
    for rank, r in enumerate(peaks):
        runs = r[name]["runs"]
        pp_rank = rank % 2
        want = sim_at_r[pp_rank] - sim_each[pp_rank]
        got = runs[False]["peak_freed_before_w"] - runs[True]["peak_freed_before_w"]
        # Within 15%: interleaved-1f1b measures 1152 bytes where the simulator says 1024.
        assert got >= 0 and abs(got - want) <= 0.15 * max(got, want), (name, rank, got, want)
        # The whole gradients alone: one stage's at most after each W, at R more or as many.
        assert runs[True]["whole_gradients_peak"] <= runs[False]["whole_gradients_peak"]
        assert runs[True]["scatter_each_w"] == 1 and runs[False]["scatter_each_w"] == 0
        saved.append(got)
    if case[0] == "interleaved-1f1b":
        # Its two stages' W alternate at the end: at R both stages' gradients are held.
        assert any(saved), (name, saved)
    else:
        # One stage a rank, 4 micro-batches: the peak is where no gradients are held
        # (as the simulator says too).
        assert not any(saved), (name, saved)
