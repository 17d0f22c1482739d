"""The DeepSpeech-2-like model: CTC on synthetic utterances it learns, every weight deferred,
and a 2-rank pipeline (1f1b with 2BP, zb-v) equal to the model in one process in float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from rank_parity import assert_equal_to_one_process
from twobp.engine import defer_weight_grads
from twobp.engine.coverage import deferred_share
from twobp.models import build_model, ctc_loss
from twobp.models.deepspeech import PAD_LABEL
from twobp.runtime import Pipeline, launch

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

TOL = 1e-9
STEPS = 3
N_MB = 2
BATCH = 4
SCHEDULES = (("1f1b", True), ("zb-v", True))


def spec64():
    return build_model("deepspeech", "tiny", dtype=torch.float64, seed=0)


def test_labels_are_padded_with_minus_100_and_ctc_matches_torch_per_utterance():
    spec = spec64()
    x, labels = spec.make_batch(3, 5)
    assert x.shape == (3, 48, 16) and labels.shape == (3, 6)
    assert (labels == PAD_LABEL).any() or (labels > 0).all()
    logits = torch.randn(3, 24, 16, dtype=torch.float64)
    per_utterance = [
        torch.nn.functional.ctc_loss(
            logits[i : i + 1].log_softmax(-1).transpose(0, 1),
            labels[i : i + 1, : int((labels[i] >= 0).sum())],
            [24],
            [int((labels[i] >= 0).sum())],
            reduction="sum",
        )
        / (labels[i] >= 0).sum()
        for i in range(3)
    ]
    torch.testing.assert_close(ctc_loss(logits, labels), torch.stack(per_utterance).mean())


def test_the_synthetic_utterances_can_be_learnt():
    """Far below the plateau of a model that only learns the labels' statistics (~2.5)."""
    torch.manual_seed(0)
    spec = build_model("deepspeech", "tiny", seed=0)
    model = spec.sequential()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(120):
        x, y = spec.make_batch(8, step)
        loss = spec.loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5, losses


def test_every_weight_of_every_block_is_deferred():
    spec = spec64()
    x = spec.example_input(2)
    for block in spec.blocks:
        store = defer_weight_grads(block)
        with store.forward(0):
            out = block(x)
        store.backward_input(0, [out], [torch.ones_like(out)], [])
        store.backward_weight([0])
        store.finish_step()
        assert deferred_share(store.routes()) == 1.0, store.report()
        x = out.detach()


def _train(schedule: str, two_bp: bool) -> dict[str, Any]:
    spec = spec64()
    x0 = spec.example_input(BATCH // N_MB)
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        schedule=schedule,
        n_microbatches=N_MB,
        two_bp=two_bp,
        device="cpu",
        timeout=60.0,
        example_input=x0,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = spec.make_batch(BATCH, step)
        losses.append(pipe.step(x, y))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        optimizer.step()
        pipe.zero_grad()
    return {
        "losses": losses,
        "grads": grads,
        "state": pipe.state_dict(),
        "schedule": pipe.schedule.name,
    }


def _session() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: _train(name, two_bp) for name, two_bp in SCHEDULES}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return launch(_session, 2, threads_per_rank=1, timeout=300)


def _reference() -> tuple[list[float], list[dict[str, Tensor]], dict[str, Tensor]]:
    spec = spec64()
    model = spec.sequential()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = spec.make_batch(BATCH, step)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, dict(model.state_dict())


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_two_ranks_equal_one_process_over_three_adamw_steps(schedule, per_rank):
    results = [r[schedule] for r in per_rank]
    assert "2bp" in results[0]["schedule"] or schedule == "zb-v", results[0]["schedule"]
    assert_equal_to_one_process(results, _reference(), TOL, every_state_entry=True)


def test_twobp_train_model_deepspeech_runs_end_to_end_with_a_falling_loss(tmp_path):
    import json

    from twobp.cli.main import main

    out = tmp_path / "run"
    code = main(
        [
            "train", "--model", "deepspeech", "--steps", "30", "--batch-size", "8",
            "--microbatches", "2", "--threads", "1", "--timeout", "60", "--no-save",
            "--two-bp", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 30
    assert metrics["loss_last"] < 0.5 * metrics["loss_first"], metrics["losses"]
    assert "synthetic utterances" in (out / "report.md").read_text()
