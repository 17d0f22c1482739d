"""Sharded parameters (ZeRO-3) under Chimera's and DualPipe's two pipelines, float64.

Each model stage is held by two ranks of a copy (rank ``s`` and rank ``P - 1 - s``)
times the copies, and sharded over all of them. Each case runs 3 clipped AdamW
steps with 2BP through ``pipe.shard_optimizer`` and must match one process running
plain AdamW on the global batch: every loss, the global norm and every parameter,
to 1e-10. Between steps a rank holds only its shards: parameters, gradients and
optimizer state at most 0.6 of the unsharded layout.

On 2 ranks Chimera lists one ``W`` over two micro-batches of model stage 1 on one
holder and one per micro-batch on the other: asked to reduce-scatter after each
``W``, that stage does so at ``R`` on both (else the reduce-scatters would not pair
up), and model stage 0, whose holders list one ``W`` each, after it.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime_models import LR, N_STEPS, assert_trained_as, clipped_adamw_reference, make_batch
from sharded_two_pipelines_workers import CLIP, PART, train_many
from twobp.runtime import launch

TOL = 1e-10
# (schedule, copies, micro-batches, scatter_each_w, small buckets, model)
TWO: list[tuple[Any, ...]] = [
    ("chimera", 1, 4, False, True, "mlp"),
    ("chimera", 1, 4, True, False, "mlp"),
    ("dualpipe", 1, 4, None, True, "mlp"),
    ("chimera", 1, 4, True, False, "tied"),
]
FOUR: list[tuple[Any, ...]] = [
    ("chimera", 2, 4, False, False, "mlp"),
    ("dualpipe", 1, 8, True, False, "mlp"),
    # A weight tied across ranks, with the copies (its reduce-scatter at R: the W of the
    # stages that read it need not pair up) and under DualPipe.
    ("1f1b", 2, 4, True, False, "tied"),
    ("dualpipe", 1, 8, False, False, "tied"),
]
pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _reference(copies: int, model: str) -> dict[str, Any]:
    batches = [[make_batch(model, step, PART * copies)] for step in range(N_STEPS)]
    return clipped_adamw_reference(model, batches, LR, CLIP)


def _check(case: tuple[Any, ...], results: list[dict[str, Any]]) -> None:
    reference = _reference(case[1], case[5])
    for rank, r in enumerate(results):
        assert_trained_as(reference, r, TOL, (case, rank))
        assert r["between"] and not any(r["between"]), (case, rank)
        assert 0 < r["held"] <= 0.6 * r["unsharded"], (case, rank, r["held"], r["unsharded"])
        # Sharded over every holder: Chimera on 2 x 2 holds a quarter, not half.
        holders = case[1] * (2 if case[0] in ("chimera", "dualpipe") else 1)
        assert r["held"] <= 1.1 * r["unsharded"] / holders, (case, rank, r["held"])
        if case[3] is True:
            assert all(r["scattered each W"]), (case, rank)
        if case[4]:
            assert all(n > 1 for n in r["buckets"].values()), (case, rank, r["buckets"])


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return launch(train_many, 2, TWO, timeout=300)


@pytest.mark.parametrize("case", TWO, ids=lambda c: "-".join(map(str, c)))
def test_two_ranks_each_stage_held_twice(two: list[dict[str, Any]], case: Any) -> None:
    _check(case, [r[repr(case)] for r in two])


def test_four_ranks() -> None:
    results = launch(train_many, 4, FOUR, timeout=300)
    for case in FOUR:
        _check(case, [r[repr(case)] for r in results])
