"""An optimizer built before a pipeline plans trains exactly as plain PyTorch, on gloo ranks.

GPT-2's head reads its token embedding: the model's parameter list holds that
weight once. Before the first step of a pipeline that plans there, its
``parameters()`` are every block's, and must hold it once too, or AdamW
steps it twice a step (float64, against one process running AdamW).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from early_optimizer_workers import PART, every_case
from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import launch

TOL = 1e-10
CASES = [
    # schedule="auto" without an example input plans on the first step's batch.
    ("auto", {"n_microbatches": 4, "auto_trials": 1}),
    ("auto", {"n_microbatches": 2, "auto_trials": 1, "data_parallel": 2}),
    # recompute="auto" without an example input plans there too: Chimera's two pipelines.
    ("chimera", {"n_microbatches": 4, "recompute": "auto", "memory_limit": "1GiB"}),
]
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ranks() -> list[list[dict[str, Any]]]:
    return launch(every_case, 4, CASES, threads_per_rank=1, timeout=600)


def _reference(copies: int) -> dict[str, Any]:
    net = nn.Sequential(*build_blocks("tied"))
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(N_STEPS):
        inputs, targets = make_batch("tied", step, PART * copies)
        loss = loss_fn("tied")(net(inputs), targets)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": net.state_dict()}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_an_optimizer_built_before_planning_trains_as_plain_pytorch(ranks, index: int) -> None:
    results = [r[index] for r in ranks]
    whole = nn.Sequential(*build_blocks("tied"))
    count = len(list(whole.parameters()))
    reference = _reference(CASES[index][1].get("data_parallel", 1))
    for rank, r in enumerate(results):
        assert r["early"], rank
        # Every block's parameters, the tied weight once, named once, before planning.
        assert r["listed"] == r["distinct"] == count, (rank, r["listed"], r["distinct"])
        assert r["named"] == [n for n, _ in whole.named_parameters()], rank
        assert r["named distinct"] == count, rank
        assert r["after"] == r["after distinct"] < count, rank
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (rank, got, want)
        for name, value in r["state"].items():
            torch.testing.assert_close(
                value, reference["state"][name], rtol=0, atol=TOL, msg=f"rank {rank} {name}"
            )
    if CASES[index][0] == "chimera":
        assert all(r["schedule"].startswith("chimera") for r in results), results[0]["schedule"]
