"""The sharded optimizer (ZeRO-1) where gradients are divided, accumulated, dropped or
skipped, and with BatchNorm buffers: 2 copies of 2 gloo ranks against plain PyTorch
on one process, float64.

The reference runs AdamW on ``nn.Sequential(*blocks)``: a ``(sum, count)`` loss is
the sum over the global batch by its count; steps without ``zero_grad`` between
them sum their gradients; a step that failed or was skipped adds nothing.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from runtime_models import (
    LR,
    build_blocks,
    loss_fn,
    reference_step,
    replicas_running_statistics,
)
from sharded_cases_workers import COPIES, N_MB, PART, PLAN, batch_of, every_case, summed_loss
from twobp.runtime import launch

TOL = 1e-10
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch(every_case, 4, list(PLAN), threads_per_rank=1, timeout=600)


def _reference(case: str) -> dict[str, Any]:
    model = "conv" if case == "batchnorm" else "mlp"
    net = nn.Sequential(*build_blocks(model))
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    norms, states = [], []
    for steps in PLAN[case]:
        for step in steps:
            if not isinstance(step, int):
                continue  # failed or skipped: no gradient
            inputs, targets = batch_of(case, step, PART * COPIES)
            if case == "batchnorm":
                before = {n: b.clone() for n, b in net.named_buffers()}
                reference_step(net, model, inputs, targets, N_MB * COPIES)
                replicas_running_statistics(net, inputs, N_MB * COPIES, COPIES, before)
            elif case == "accumulate":
                loss_fn(model)(net(inputs), targets).backward()
            else:
                total, count = summed_loss(net(inputs), targets)
                (total / count).backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.clone() for k, v in net.state_dict().items()})
    return {"norms": norms, "states": states}


@pytest.mark.parametrize("case", list(PLAN))
def test_sharded_optimizer_trains_as_plain_pytorch(ranks, case: str) -> None:
    reference = _reference(case)
    for rank, result in enumerate(r[case] for r in ranks):
        for got, want in zip(result["norms"], reference["norms"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (case, rank, got, want)
        for index, (state, want) in enumerate(
            zip(result["states"], reference["states"], strict=True)
        ):
            assert state, (case, rank)
            for name, value in state.items():
                torch.testing.assert_close(
                    value, want[name], rtol=0, atol=TOL, msg=f"{case} rank {rank} {index} {name}"
                )


def test_the_failed_step_failed_and_the_skipped_step_was_skipped_on_every_rank(ranks) -> None:
    # Copy 1's last micro-batch fails on its last stage (rank 3): it raises its own error,
    # every other rank is told.
    failed = [r["failed"]["failures"] for r in ranks]
    assert failed == [["PeerStepFailedError"]] * 3 + [["ValueError"]], failed
    assert [r["skipped"]["skipped"] for r in ranks] == [[1]] * 4
    assert [r["skipped"]["failures"] for r in ranks] == [["no error"]] * 4
