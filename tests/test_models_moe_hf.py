"""A Hugging Face Mixtral (tiny, float64, eager experts) through
``integrations.transformers.blocks`` on 2 ranks equals the model in one process over 3
AdamW steps: the loss with the routers' auxiliary term, every gradient and the parameters
after, for 1f1b with and without 2BP, zb-v and dualpipev. With 2BP its experts' and
routers' weight gradients are deferred; micro-batch 3 routes no token to expert 0 of
the first layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from rank_parity import assert_equal_to_one_process
from twobp.runtime import Pipeline, launch

transformers = pytest.importorskip("transformers")
from test_integrations_transformers_routers import (  # noqa: E402
    assert_grads_close,
    make_batch,
    make_model,
    model_loss,
)
from twobp.integrations.transformers import blocks, loss_function  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

STEPS, N_MB, TOL = 3, 4, 1e-10
SCHEDULES = (("1f1b", True), ("1f1b", False), ("zb-v", True), ("dualpipev", True))


def _train(schedule: str, two_bp: bool) -> dict[str, Any]:
    model = make_model("mixtral")
    pipe = Pipeline(
        blocks(model),
        loss_function(model),
        schedule=schedule,
        n_microbatches=N_MB,
        two_bp=two_bp,
        device="cpu",
        timeout=60.0,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ids, mask, labels = make_batch()
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(pipe.step((ids, mask), labels))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        optimizer.step()
        pipe.zero_grad()
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _session() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {f"{s}-{b}": _train(s, b) for s, b in SCHEDULES}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return launch(_session, 2, threads_per_rank=1, timeout=300)


def _reference() -> tuple[list[float], list[dict[str, Tensor]], dict[str, Tensor]]:
    model = make_model("mixtral")
    named = dict(blocks(model).named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask, labels = make_batch()
    losses, grads = [], []
    for _ in range(STEPS):
        total = torch.zeros((), dtype=torch.float64)
        for part in zip(*(t.chunk(N_MB) for t in (ids, mask, labels)), strict=True):
            total = total + model_loss(model, *part) / N_MB
        total.backward()
        losses.append(float(total))
        grads.append({n: p.grad.clone() for n, p in named.items() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach() for n, p in named.items()}


def test_some_micro_batch_routes_no_token_to_an_expert():
    model = make_model("mixtral")
    ids, mask, _ = make_batch()
    out = model(input_ids=ids[3:], attention_mask=mask[3:], output_router_logits=True)
    chosen = torch.topk(out.router_logits[0], 2).indices.flatten()
    assert 0 in torch.bincount(chosen, minlength=4).tolist()


@pytest.mark.parametrize("schedule", [f"{s}-{b}" for s, b in SCHEDULES])
def test_two_ranks_equal_one_process_over_three_adamw_steps(schedule, per_rank):
    results = [r[schedule] for r in per_rank]
    assert_equal_to_one_process(
        results,
        _reference(),
        TOL,
        state_key="params",
        every_state_entry=True,
        grads_close=assert_grads_close,
    )
