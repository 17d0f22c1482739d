"""The mixture-of-experts decoder: routed experts deferred per expert, the load-balancing
loss in the training loss, and 2-rank pipelines equal to one process in float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from rank_parity import assert_equal_to_one_process
from twobp.engine import defer_weight_grads
from twobp.engine.coverage import deferred_share
from twobp.models import build_model
from twobp.models.moe import MoeBlock, load_balancing_loss
from twobp.runtime import Pipeline, launch

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

TOL = 1e-10
STEPS = 3
N_MB = 4
BATCH = 4
# One sequence of 3 tokens per micro-batch routes 6 slots to 8 experts: in every
# micro-batch some expert gets no token.
SIZE = {"n_layers": 2, "seq_len": 3, "shared_ffn_dim": 16, "aux_weight": 0.5}
SCHEDULES = (("1f1b", True), ("1f1b", False), ("zb-v", True), ("dualpipev", True))


def spec64():
    return build_model("moe", "tiny", dtype=torch.float64, seed=0, **SIZE)


def test_every_weight_of_every_block_is_deferred():
    spec = spec64()
    x: Any = spec.example_input(2)
    for block in spec.blocks:
        store = defer_weight_grads(block)
        with store.forward(0):
            out = block(x)
        outs = list(out) if isinstance(out, tuple) else [out]
        store.backward_input(0, outs, [torch.ones_like(o) for o in outs], [])
        store.backward_weight([0])
        store.finish_step()
        assert deferred_share(store.routes()) == 1.0, store.report()
        x = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()


def test_load_balancing_loss_is_one_when_balanced_and_larger_when_not():
    probs = torch.full((4, 4), 0.25, dtype=torch.float64)
    balanced = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert load_balancing_loss(probs, balanced).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0, 1]] * 4)
    peaked = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 4, dtype=torch.float64)
    assert load_balancing_loss(peaked, skewed).item() == pytest.approx(2.0)


def test_the_loss_adds_the_weighted_aux_loss_of_every_layer():
    spec = spec64()
    x, y = spec.make_batch(2, 0)
    logits, aux = spec.sequential()(x)
    blocks = [b for b in spec.blocks if isinstance(b, MoeBlock)]
    assert len(blocks) == 2 and aux.item() > 0
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert spec.loss_fn((logits, aux), y).item() == pytest.approx(plain.item() + 0.5 * aux.item())


def _train(schedule: str, two_bp: bool) -> dict[str, Any]:
    spec = spec64()
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        schedule=schedule,
        n_microbatches=N_MB,
        two_bp=two_bp,
        device="cpu",
        timeout=60.0,
        example_input=spec.example_input(BATCH // N_MB),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = spec.make_batch(BATCH, step)
        losses.append(pipe.step(x, y))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        optimizer.step()
        pipe.zero_grad()
    return {"losses": losses, "grads": grads, "state": pipe.state_dict()}


def _session() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {f"{name}-{two_bp}": _train(name, two_bp) for name, two_bp in SCHEDULES}


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
        total = 0.0
        for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB), strict=True):
            loss = spec.loss_fn(model(xm), ym) / N_MB
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, dict(model.state_dict())


@pytest.mark.parametrize("schedule", [f"{s}-{b}" for s, b in SCHEDULES])
def test_two_ranks_equal_one_process_over_three_adamw_steps(schedule, per_rank):
    results = [r[schedule] for r in per_rank]
    assert_equal_to_one_process(results, _reference(), TOL)


def test_twobp_train_model_moe_runs_end_to_end(tmp_path):
    import json

    from twobp.cli.main import main

    out = tmp_path / "run"
    code = main(
        [
            "train", "--model", "moe", "--steps", "8", "--batch-size", "8", "--microbatches",
            "4", "--threads", "1", "--timeout", "60", "--no-save", "--two-bp", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 8
    assert metrics["loss_last"] < metrics["loss_first"], metrics["losses"]
    # The report says how many expert weights W concatenated per expert, from the stores.
    from twobp.models import build_model

    spec = build_model("moe", "tiny")
    stacked = [n for n, p in spec.blocks[1].named_parameters() if p.dim() == 3]
    layers = sum(1 for b in spec.blocks if any(p.dim() == 3 for p in b.parameters()))
    experts = next(p for p in spec.blocks[1].parameters() if p.dim() == 3).shape[0]
    line = (
        f"{len(stacked) * layers} stacked expert weights concatenated per expert over the "
        f"micro-batches ({len(stacked) * layers * experts} expert products)"
    )
    assert line in (out / "report.md").read_text()
    assert (
        "100.0% of the split stages' weight elements deferred to W"
        in (out / "report.md").read_text()
    )
