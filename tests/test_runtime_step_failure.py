"""A step that fails on one rank fails on every rank at once, and the pipeline goes on.

The failing rank completes the step's transfers with placeholders, so no
peer waits on it; at the step's end every rank learns who failed, where and
why. The next step of the same pipeline equals one process's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime_models import build_blocks, loss_fn, make_batch
from step_failure_workers import (
    BATCH,
    construction_and_save_failures,
    failing_replicated_steps,
    failing_steps,
    failing_steps_cut_uniformly,
    failing_steps_dynamic,
    failure_then_other_work,
)
from twobp.runtime import launch

# A rank that waited for the failed rank until this timeout would end its step with a
# PeerTimeoutError instead of the PeerStepFailedError (naming the failed rank) that every
# check below asks for.
TIMEOUT = 30.0
TOL = 1e-10


@pytest.fixture(scope="module")
def reference():
    model = nn.Sequential(*build_blocks("mlp"))
    x, y = make_batch("mlp", 0, BATCH)
    loss = loss_fn("mlp")(model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _check(results, case, failing_rank, error_type, text, reference):
    want_loss, want_grads = reference
    for rank, result in enumerate(results):
        got = result[case]
        name, message = got["failed"]
        if rank == failing_rank:
            assert name == error_type and text in message, (case, rank, message)
        else:
            assert name == "PeerStepFailedError", (case, rank, name, message)
            assert message.startswith(f"rank {rank}: rank {failing_rank} failed at "), message
            assert f"{error_type}: " in message and text in message
            assert "the pipeline can run the next step" in message
        assert got["grads dropped"], (case, rank)
        assert got["loss"] == pytest.approx(want_loss, abs=TOL, rel=0)
        for n, g in got["grads"].items():
            torch.testing.assert_close(g, want_grads[n], rtol=0, atol=TOL)


def test_failures_on_the_first_middle_and_last_of_three_ranks(reference):
    cases = [
        ("block", 0, True),  # stage 0, first step: no layout crossed yet
        ("block", 5, False),
        ("block", 9, True),
        ("shape", 2, False),  # the last block of stage 0 (blocks 0-2 | 3-6 | 7-9)
        ("shape", 6, False),
        ("loss", 9, False),
    ]
    results = launch(failing_steps, 3, cases, TIMEOUT, threads_per_rank=1, timeout=300)
    _check(results, "block 0 first", 0, "RuntimeError", "block failed on purpose", reference)
    _check(results, "block 5 later", 1, "RuntimeError", "block failed on purpose", reference)
    _check(results, "block 9 first", 2, "RuntimeError", "block failed on purpose", reference)
    _check(results, "shape 2 later", 0, "ShapeMismatchError", "float32", reference)
    _check(results, "shape 6 later", 1, "ShapeMismatchError", "float32", reference)
    _check(results, "loss 9 later", 2, "ValueError", "it must return a scalar", reference)


def test_failures_on_four_ranks(reference):
    cases = [("block", 3, True), ("loss", 9, False)]
    results = launch(failing_steps, 4, cases, TIMEOUT, threads_per_rank=1, timeout=300)
    _check(results, "block 3 first", 1, "RuntimeError", "block failed on purpose", reference)
    _check(results, "loss 9 later", 3, "ValueError", "it must return a scalar", reference)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_failures_with_two_stages_per_rank(schedule, reference):
    # Stages 0 and 3 on rank 0, 1 and 2 on rank 1 (zb-v); 0, 2 | 1, 3 (interleaved); cut
    # uniformly (blocks 0-2, 3-5, 6-7, 8-9), so that block 4 is on rank 1.
    cases = [("block", 0, True), ("block", 4, False), ("loss", 9, False)]
    results = launch(
        failing_steps_cut_uniformly, 2, cases, TIMEOUT, schedule, threads_per_rank=1, timeout=300
    )
    _check(results, "block 0 first", 0, "RuntimeError", "block failed on purpose", reference)
    _check(results, "block 4 later", 1, "RuntimeError", "block failed on purpose", reference)
    last = 0 if schedule == "zb-v" else 1
    _check(results, "loss 9 later", last, "ValueError", "it must return a scalar", reference)


def test_the_failing_rank_goes_on_to_save_and_another_pipeline(tmp_path):
    results = launch(
        failure_then_other_work, 2, str(tmp_path), TIMEOUT, threads_per_rank=1, timeout=300
    )
    assert results[1]["failed"][0] == "RuntimeError"
    assert results[0]["failed"][0] == "PeerStepFailedError"
    assert results[0]["other loss"] == results[1]["other loss"]
    assert (tmp_path / "step-00000000" / "manifest.json").is_file()  # the failed step did not count


def test_a_rank_that_fails_to_build_or_save_tells_the_others(tmp_path):
    results = launch(
        construction_and_save_failures, 2, str(tmp_path), TIMEOUT, threads_per_rank=1, timeout=300
    )
    for rank, result in enumerate(results):
        name, message = result["build"]
        if rank == 1:
            assert name == "RuntimeError" and "cannot move this block, on purpose" in message
        else:
            assert name == "PeerFailedError"
            assert message.startswith("rank 1 reported: cannot move this block, on purpose")
        name, message = result["save"]
        assert name == "CheckpointError", message
        assert "extra is a function: a checkpoint keeps JSON data only" in message
        assert result["saved after"].endswith("step-00000001")


def test_failures_of_replicated_stages_end_the_step_on_every_rank_at_once(reference):
    results = launch(failing_replicated_steps, 4, TIMEOUT, threads_per_rank=1, timeout=300)
    # Rank 3 holds stage 0 of the up pipeline of copy 1 (model blocks 0-4) and stage 1 of its
    # down pipeline (blocks 5-9): each failure is its own, and every other rank is told at once.
    _check(results, "block 0", 3, "RuntimeError", "block failed on purpose", reference)
    _check(results, "block 9", 3, "RuntimeError", "block failed on purpose", reference)
    _check(results, "loss 9", 3, "ValueError", "it must return a scalar", reference)
    for rank, result in enumerate(results):
        second = result["second pipeline"]
        assert second["caught"] == ["PipelineConfigError", "PipelineConfigError"]
        name, message = second["failed"]
        assert name == ("ValueError" if rank == 3 else "PeerStepFailedError"), message


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_failures_under_the_dynamic_policy(schedule, reference):
    """Ranks that fill their waits with W (their receives waited for on threads) still
    learn of a peer's failure, and the next step equals one process's."""
    cases = [("block", 5, False), ("shape", 4, False), ("loss", 9, False)]
    if schedule == "zb-v":
        cases.pop(1)
    results = launch(
        failing_steps_dynamic, 2, cases, TIMEOUT, schedule, threads_per_rank=1, timeout=300
    )
    last = 0 if schedule == "zb-v" else 1
    _check(results, "block 5 later", 1, "RuntimeError", "block failed on purpose", reference)
    if schedule == "1f1b":  # block 4 ends stage 0
        _check(results, "shape 4 later", 0, "ShapeMismatchError", "float32", reference)
    _check(results, "loss 9 later", last, "ValueError", "it must return a scalar", reference)
