"""Parameters, gradients and optimizer state sharded over the copies (ZeRO-3), float64.

Each case runs 2 x 2 gloo ranks (2 copies of a 2-rank pipeline) with
``shard_parameters=True`` and 2BP, 3 clipped AdamW steps through
``pipe.shard_optimizer``, with and without gradient accumulation (two
pipeline steps per optimizer step), and must match one process running plain
AdamW on the global batch: every loss, the global norm and every parameter,
to 1e-10. Between steps a rank holds only its shards: parameters, gradients
and optimizer state at most 0.6 of the unsharded layout.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from runtime_models import (
    LR,
    N_STEPS,
    assert_trained_as,
    build_blocks,
    clipped_adamw_reference,
    loss_fn,
)
from sharded_parameters_workers import (
    CLIP,
    auto_schedule,
    batch_of,
    checkpoint_round_trip,
    compiled_against_eager,
    dropout_against_unsharded,
    failed_step,
    refusals,
    scaled_against_unsharded_parameters,
    train_many,
)
from twobp.runtime import launch

TOL = 1e-10
CASES: list[tuple[Any, ...]] = [
    (schedule, accumulate)
    for schedule in ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")
    for accumulate in (1, 2)
]
# A recomputed forward: in I (activations, weights still gathered), or in every W
# (derivatives: the stage keeps its weights until its last W).
CASES += [("zb-h1", 1, "activations"), ("zb-h1", 1, "derivatives")]
pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _reference(accumulate: int) -> dict[str, Any]:
    batches = [[batch_of(step, micro, 2) for micro in range(accumulate)] for step in range(N_STEPS)]
    return clipped_adamw_reference("mlp", batches, LR, CLIP)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(train_many, 4, CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sharded_parameters_match_one_process(results: list[dict[str, Any]], case: Any) -> None:
    reference = _reference(case[1])
    assert any(r[repr(case)]["held at W"] for r in results), "some rank ran a W"
    for rank, r in enumerate(results):
        r = r[repr(case)]
        assert_trained_as(reference, r, TOL, (case, rank))
        assert r["between"] and not any(r["between"]), (case, rank)
        assert not any(r["gathered after a step"]), (case, rank)
        # Each stage's last W of a step ran on the shards alone: its weights were freed
        # after its last I (earlier W's may run between I's, the weights still held).
        last = {(step, stage): held for step, stage, held in r["held at W"]}
        rebuilt_at_w = case[2:] == ("derivatives",)
        assert all(h == rebuilt_at_w for h in last.values()), (case, rank, r["held at W"])
        assert "pipe.shard_optimizer" in r["refused plain"], r["refused plain"]
        assert "pipe.shard_optimizer" in r["refused named"], r["refused named"]


@pytest.mark.parametrize("case", CASES[:1] + CASES[4:5], ids=str)
def test_sharded_state_per_rank(results: list[dict[str, Any]], case: Any) -> None:
    for rank, r in enumerate(results):
        r = r[repr(case)]
        stats = r["stats"]
        held = stats["parameters"] + stats["optimizer"]
        assert 0 < held <= 0.6 * r["unsharded"], (case, rank, held, r["unsharded"])
        # The step gathered the rank's whole stages, and no more.
        assert r["stage bytes"] <= stats["gathered_peak"] <= 1.1 * r["stage bytes"], (
            case,
            rank,
            stats,
        )


def test_freeing_before_w_lowers_the_peak_where_weights_and_stashes_meet(
    results: list[dict[str, Any]],
) -> None:
    # Activations, stashes and gathered weights at once, measured as the step ran, against
    # the same step had each stage kept its weights through its W: never above it, and
    # below it on interleaved-1f1b's second rank, whose stashes peak while a stage's W run.
    for case in CASES[:8]:
        for rank, r in enumerate(results):
            stats = r[repr(case)]["stats"]
            assert stats["peak_freed_before_w"] <= stats["peak_freed_after_w"], (case, rank)
    lower = [r[repr(("interleaved-1f1b", 1))]["stats"] for r in results]
    assert any(s["peak_freed_before_w"] < s["peak_freed_after_w"] for s in lower), lower


def test_two_copies_of_a_pipeline_of_four_ranks() -> None:
    case = ("zb-h1", 2)
    results = [r[repr(case)] for r in launch(train_many, 8, [case], timeout=600)]
    reference = _reference(case[1])
    for rank, r in enumerate(results):
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (rank, got, want)
        for name, value in r["state"].items():
            torch.testing.assert_close(value, reference["state"][name], rtol=0, atol=TOL)


def test_refusals() -> None:
    for r in launch(refusals, 4, timeout=300):
        assert "data_parallel=2 or more" in r["one copy"], r["one copy"]


def test_autocast_and_grad_scaler_step_as_with_whole_parameters() -> None:
    # float16 autocast under a GradScaler: the same losses, scales, skips, norms and
    # parameters as with the optimizer state sharded alone.
    for r in launch(scaled_against_unsharded_parameters, 4, timeout=300):
        whole, sharded = r["sharded=False"], r["sharded=True"]
        for key in ("losses", "scales", "skipped", "norms"):
            assert sharded[key] == whole[key], (key, sharded[key], whole[key])
        for name, value in whole["state"].items():
            torch.testing.assert_close(sharded["state"][name], value, rtol=0, atol=0)


def test_auto_schedule_trials_leave_the_parameters_to_the_pipeline() -> None:
    inputs, targets = batch_of(0, 0, 2)
    with torch.no_grad():
        want = float(loss_fn("mlp")(nn.Sequential(*build_blocks("mlp"))(inputs), targets))
    for got in launch(auto_schedule, 4, timeout=300):
        assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (got, want)


def test_checkpoints_load_sharded_unsharded_and_at_other_layouts(tmp_path) -> None:
    # Saved sharded on 2 x 2 (zb-h1) after 2 steps; loaded sharded on 2 x 2 (1f1b), unsharded
    # on 2 x 2 (which saves it again), then sharded on 4 copies of one stage: each third step
    # equals the step of the pipeline that saved it.
    for r in launch(checkpoint_round_trip, 4, str(tmp_path), timeout=300):
        want_loss, want = r["saved"]
        for key in ("sharded", "unsharded", "4 copies"):
            loss, state = r[key]
            assert math.isclose(loss, want_loss, rel_tol=0, abs_tol=TOL), (key, loss, want_loss)
            for name, value in want.items():
                torch.testing.assert_close(state[name], value, rtol=0, atol=TOL, msg=key)


def test_a_failed_step_frees_the_weights_and_the_next_step_runs() -> None:
    results = launch(failed_step, 4, timeout=300)
    assert sorted(r[0] for r in results) == ["PeerStepFailedError"] * 3 + ["ValueError"]
    for error, again, fresh, held in results:
        assert again == fresh and not held, (error, again, fresh, held)


def test_dropout_draws_as_with_whole_parameters() -> None:
    # The same masks and updates as the optimizer state sharded alone, from the same seeds,
    # also where a recomputed forward replays them (in I, or in every W).
    modes = [None, "activations", "derivatives"]
    for r in launch(dropout_against_unsharded, 4, modes, timeout=300):
        for mode in modes:
            whole, sharded = r[f"{mode} sharded=False"], r[f"{mode} sharded=True"]
            assert sharded["losses"] == whole["losses"], (mode, sharded, whole)
            for name, value in whole["state"].items():
                torch.testing.assert_close(
                    sharded["state"][name], value, rtol=0, atol=0, msg=f"{mode} {name}"
                )


def test_compiled_stages_step_as_eager_and_stay_compiled() -> None:
    # compile=True compiles each stage whole: it waits for its gathered weights before its
    # forward (no hook inside the compiled frame, which dynamo would trace and recompile on
    # every gather's state until it gave up compiling).
    for r in launch(compiled_against_eager, 4, timeout=300):
        eager, compiled = r["compiled=False"], r["compiled=True"]
        assert not compiled["warnings"], compiled["warnings"]
        for got, want in zip(compiled["losses"], eager["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (got, want)
        for name, value in eager["state"].items():
            torch.testing.assert_close(compiled["state"][name], value, rtol=0, atol=TOL)
