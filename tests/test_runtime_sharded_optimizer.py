"""The optimizer sharded over the replicas (ZeRO-1) on real gloo ranks, float64.

Each case trains 3 AdamW steps through ``pipe.shard_optimizer`` (clipped to a
small global norm, with a StepLR schedule) and must match one process
running plain AdamW on the global batch: loss, global norm and every
parameter, to 1e-10. The optimizer state per rank must be at most 0.55 of the
unsharded state for two copies (Chimera's and DualPipe's two pipelines are two
copies of each stage).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from runtime_models import LR, N_STEPS, assert_trained_as, clipped_adamw_reference, make_batch
from sharded_optimizer_workers import CLIP, N_MB, PART, checkpoints, train_many
from twobp.runtime import launch
from twobp.sim import CostModel

TOL = 1e-10
# About 360 parameters a stage of 2 x 2 ranks: 2.9 kB of AdamW state, 1.4 kB a holder sharded.
LIMIT = 2200.0
AUTO = {
    "costs": CostModel.uniform(2, activation_bytes=1.0, weight_grad_bytes=1.0),
    "memory_limit": LIMIT,
    "optimizer_state_bytes": 8.0,
    "optimizer_sharded": True,
}
pytestmark = pytest.mark.usefixtures("torch_one_thread")

FOUR = [
    ("mlp", "1f1b", True, {"data_parallel": 2}),
    ("mlp", "zb-h1", True, {"data_parallel": 2}),
    ("mlp", "interleaved-1f1b", True, {"data_parallel": 2}),
    # Replicas of another kind: Chimera's and DualPipe's two pipelines, a weight tied
    # across ranks, and DualPipeV's V under copies. (Chimera with a tied weight first: it
    # makes more reduction groups on some ranks than on others, which the pipelines
    # built after it must not trip over.)
    ("tied", "chimera", True, {}),
    ("mlp", "dualpipe", True, {"n_microbatches": 2 * N_MB}),
    ("tied", "1f1b", True, {"data_parallel": 2}),
    ("mlp", "dualpipev", True, {"data_parallel": 2}),
    # schedule="auto" counts the optimizer state: LIMIT fits its share per holder only.
    ("mlp", "auto", True, {"data_parallel": 2, **AUTO}),
]
EIGHT = [("mlp", "1f1b", True, {"data_parallel": 2})]


def _reference(model: str, copies: int) -> dict[str, Any]:
    batches = [[make_batch(model, step, PART * copies)] for step in range(N_STEPS)]
    return clipped_adamw_reference(model, batches, LR, CLIP, halve_lr_each_step=True)


def _check(case: tuple[str, str, bool, dict[str, Any]], results: list[dict[str, Any]]) -> None:
    model, _, _, options = case
    copies = options.get("data_parallel", 1)
    reference = _reference(model, copies)
    for rank, r in enumerate(results):
        assert r["kind"] == "AdamW"
        assert_trained_as(reference, r, TOL, (case, rank))
        assert r["optimizer"] == r["own"] > 0, (case, rank)
        # The gathers start in the order of the stages' first F (interleaved: not that of R).
        stages = [k for k in r["gathers"] if k.startswith("stage ")]
        assert stages == [k for k in r["forwards"] if k in stages], (case, rank, r["gathers"])
        if case[1] == "auto":
            assert r["peak"] <= LIMIT, (rank, r["peak"])
            assert "no schedule fits memory_limit" in r.get("refused", ""), r.get("refused")
        assert r["own"] <= 0.55 * r["unsharded"], (case, rank, r["own"], r["unsharded"])


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return launch(train_many, 4, FOUR, timeout=600)


def _name(case: tuple[str, str, bool, dict[str, Any]]) -> str:
    shown = {k: v for k, v in case[3].items() if k != "costs"}
    return f"{case[0]}-{case[1]}-{shown}"


@pytest.mark.parametrize("case", FOUR, ids=_name)
def test_sharded_matches_one_process(four: list[dict[str, Any]], case: Any) -> None:
    _check(case, [r[repr(case)] for r in four])


def test_checkpoints_load_on_other_layouts_and_unsharded(tmp_path) -> None:
    results = launch(checkpoints, 4, str(tmp_path), timeout=600)
    want = results[0]
    # Copy 0 ran its blocks before copy 1 took part in their gathers; each block waited.
    assert [r["blocks wait"] for r in results] == [(True, "raced")] * 4
    for r in results:
        assert r["half"] == dict.fromkeys(("resumed", "float32", "rounded", "finer"), True), r[
            "half"
        ]
        assert "takes no other group" in r["refused"], r["refused"]
        assert "pass only its options" in r["refused params"], r["refused params"]
    for rank, r in enumerate(results):
        for other in ("plain", "again", "wide"):
            assert math.isclose(r[f"{other} third"], want["third"], rel_tol=0, abs_tol=TOL), (
                other,
                rank,
            )
    merged: dict[str, torch.Tensor] = {}
    for key in ("state", "plain state", "again state", "wide state"):
        held: dict[str, torch.Tensor] = {}
        for r in results:
            held.update(r[key])
        if not merged:
            merged = held
        assert set(held) == set(merged), key
        for name, value in held.items():
            torch.testing.assert_close(value, merged[name], rtol=0, atol=TOL, msg=f"{key} {name}")


def test_two_by_four() -> None:
    results = launch(train_many, 8, EIGHT, timeout=600)
    _check(EIGHT[0], [r[repr(EIGHT[0])] for r in results])


assert N_MB == 4
