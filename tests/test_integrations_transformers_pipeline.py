"""Hugging Face models as a `twobp.Pipeline` on 2 gloo ranks, against the model in one process.

One launch builds every family (untied, float64) under several schedules, runs
one step of a padded batch whose mask travels with the hidden states, and
returns each rank's loss and gradients; the parent compares them with the
model's own forward and backward over the whole batch. The families that tie
the head to the embedding (GPT-2, BERT, Mamba) also run tied, as published:
the embedding on rank 0 and the head on rank 1 then hold one weight.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from twobp.runtime import Pipeline, launch

transformers = pytest.importorskip("transformers")
from test_integrations_transformers import model_logits  # noqa: E402
from twobp.integrations.transformers import (  # noqa: E402
    FAMILIES,
    SIZES,
    blocks,
    build_model,
    loss_function,
)

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

TOL = 1e-10
GRAD_TOL = {"mamba": {"rtol": 1e-5, "atol": 1e-8}}
"""(rtol, atol) of the gradients where they are not ``(0, TOL)``: Mamba's own selective
scan runs in float32 (``A_log.float()``, ``D.float()``) whatever the model's dtype, so a
batch summed in two micro-batches differs from one sum by float32 rounding."""
N_MB = 2
SCHEDULES = (("1f1b", True), ("gpipe", False), ("zb-h1", True))
TIED = ("gpt2", "bert", "mamba")
CASES = [
    *[(kind, schedule, two_bp, False) for kind in FAMILIES for schedule, two_bp in SCHEDULES],
    *[(kind, schedule, True, True) for kind in TIED for schedule in ("1f1b", "zb-h1")],
]


def make_model(kind: str, tied: bool = False) -> torch.nn.Module:
    """A tiny float64 model of the family, from a fixed seed."""
    torch.manual_seed(0)
    return build_model(kind, "tiny", tied=tied).double()


def make_batch() -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, labels)`` of 2 micro-batches of 2 rows.

    The second row of each micro-batch is padded on the left, so that every
    micro-batch holds as many labels: the mean of the micro-batch losses is
    then the loss of the whole batch.
    """
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, SIZES["tiny"]["vocab_size"], (2 * N_MB, 12), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for row in range(1, 2 * N_MB, 2):
        mask[row, :3] = 0
        labels[row, :3] = -100
    return ids, mask, labels


def _run_case(kind: str, schedule: str, two_bp: bool, tied: bool) -> dict[str, Any]:
    model = make_model(kind, tied)
    pipe = Pipeline(
        blocks(model),
        loss_function(model),
        schedule=schedule,
        n_microbatches=N_MB,
        two_bp=two_bp,
        device="cpu",
        timeout=60.0,
    )
    ids, mask, labels = make_batch()
    loss = pipe.step((ids, mask), labels)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads, "schedule": pipe.schedule.name}


def _session() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {str(case): _run_case(*case) for case in CASES}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return launch(_session, 2, threads_per_rank=1, timeout=300)


def reference(kind: str, tied: bool = False) -> tuple[float, dict[str, Tensor]]:
    """The model's loss and gradients over the whole batch, named as its blocks name them.

    The loss is :func:`loss_function`'s on the model's own logits, kept in float64
    (the model's own loss, and Mamba's logits, would round them to float32).
    """
    model = make_model(kind, tied)
    ids, mask, labels = make_batch()
    loss = loss_function(model)(model_logits(model, ids, mask), labels)
    loss.backward()
    named = blocks(model).named_parameters()
    return float(loss), {n: p.grad for n, p in named if p.grad is not None}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_pipeline_on_two_ranks_equals_the_model_in_one_process(case, per_rank):
    kind, schedule, two_bp, tied = case
    want_loss, want_grads = reference(kind, tied)
    results = [r[str(case)] for r in per_rank]
    if schedule != "zb-h1":  # split by its own definition
        assert ("2bp" in results[0]["schedule"]) == two_bp
    grads: dict[str, Tensor] = {}
    tol = GRAD_TOL.get(kind, {"rtol": 0.0, "atol": TOL})
    for rank, r in enumerate(results):
        assert math.isclose(r["loss"], want_loss, rel_tol=0, abs_tol=TOL), (rank, r["loss"])
        assert r["grads"], f"rank {rank} holds no parameters"
        shared = set(grads) & set(r["grads"])
        # Only the tied weight lives on both ranks, under its first name, with one gradient.
        assert len(shared) == (int(tied) if rank else 0), shared
        for name in shared:
            torch.testing.assert_close(r["grads"][name], grads[name], rtol=0, atol=0)
        grads.update(r["grads"])
    assert set(grads) == set(want_grads)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, **tol, msg=lambda m, n=name: f"{n}: {m}")
