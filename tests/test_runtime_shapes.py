"""Batches whose shapes change: other sequence lengths, batch sizes, uneven micro-batches.

One launch of 2 gloo ranks trains every schedule family on steps that change the
sequence length, the batch size and whether it divides into the micro-batches,
and come back to shapes seen before; it evaluates on a new shape, trains with
a sum-and-count loss on padded targets, passes too few rows and a block whose
output shape depends on values. One launch of 4 ranks runs two data-parallel
copies on parts of the batch of different sizes. Everything is compared in
float64 with one process on the whole batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shape_workers import (
    DP_SHAPES,
    EVAL_SHAPES,
    FAMILIES,
    TRAIN_SHAPES,
    VOCAB,
    build_value_dependent,
    data_parallel_session,
    make_batch,
    mean_loss,
    reference,
    reference_eval,
    shapes_session,
    sharded_session,
    token_mean,
    trained_reference,
    value_dependent_batch,
)
from twobp.runtime import launch
from twobp.runtime.communication.agreement import SMALL_BITS
from twobp.runtime.communication.layout_cache import LAYOUT_SLOTS, LayoutCache
from twobp.runtime.execution.memory import SIGNATURES_KEPT, MemoryMeter
from twobp.runtime.execution.step_start import OVERFLOW, CallInfo

TOL = 1e-10
TIMEOUT = 30.0

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def session() -> list[dict[str, Any]]:
    return launch(shapes_session, 2, FAMILIES, TIMEOUT, threads_per_rank=1, timeout=300)


def _merged_grads(results: list[dict[str, Any]], key: str, step: int) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for rank in results:
        grads.update(rank[key]["grads"][step])
    return grads


def _compare(results: list[dict[str, Any]], key: str, expected: dict[str, Any]) -> None:
    for step, loss in enumerate(expected["losses"]):
        for rank in results:
            assert rank[key]["losses"][step] == pytest.approx(loss, abs=TOL), (key, step)
        grads = _merged_grads(results, key, step)
        assert grads.keys() == expected["grads"][step].keys()
        for name, grad in expected["grads"][step].items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=TOL, msg=f"{key} {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_one_process_as_shapes_change(session, family):
    _compare(session, family, reference(TRAIN_SHAPES))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shape_seen_before_sends_no_layout_message(session, family):
    seen: set[tuple[int, int]] = set()
    for step, shape in enumerate(TRAIN_SHAPES):
        counts = [rank[family]["messages"][step] for rank in session]
        if shape in seen:
            assert counts == [0, 0], (step, shape)
        else:
            assert all(c > 0 for c in counts), (step, shape, counts)
        seen.add(shape)


def test_memory_statistics_follow_the_shapes(session):
    for rank in session:
        held = rank["1f1b"]["memory"]
        # (8, 6) at steps 0 and 3, (6, 6) at 2 and 5; (8, 10) holds more than (8, 6).
        assert held[0] == held[3] and held[2] == held[5]
        assert held[1] > held[0] >= held[2] > 0


def test_the_memory_meter_keeps_a_bounded_number_of_signatures():
    meter = MemoryMeter(torch.device("cpu"))
    for n in range(SIGNATURES_KEPT + 1):
        meter.learn_saved(0, (n,), {("cpu", 1): 8 * n}, {})
    assert meter.saved_beyond(0, (0,)) is None
    assert meter.saved_beyond(0, (1,)) == 8 and meter.saved_beyond(0, (SIGNATURES_KEPT,)) == (
        8 * SIGNATURES_KEPT
    )


def test_evaluation_on_a_new_shape(session):
    expected = reference_eval(EVAL_SHAPES)
    outputs = session[1]["eval"]["outputs"]
    assert session[0]["eval"]["outputs"] == [None, None]
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    # Evaluation learns its own layouts once per shape: one per size of micro-batch
    # (7 rows are 2, 2, 2 and 1).
    assert [r["eval"]["messages"] for r in session] == [[2, 0], [2, 0]]
    logits = expected[0]
    targets = make_batch(100, *EVAL_SHAPES[0])[1]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    assert session[0]["eval"]["loss"] == pytest.approx(float(loss), abs=TOL)


def test_a_sum_and_count_loss_gives_the_exact_token_mean(session):
    _compare(session, "sum and count", reference(TRAIN_SHAPES, token_mean, padded=True))


def test_fewer_rows_than_microbatches_is_refused_on_every_rank(session):
    for rank in session:
        kind, message = rank["too few rows"]
        assert kind == "PipelineConfigError"
        assert "batch size 3, fewer rows than the 4 micro-batches" in message


def test_a_value_dependent_shape_fails_on_every_rank_naming_the_boundary(session):
    first, second = (rank["value dependent"] for rank in session)
    kind, message = first["error"]
    assert kind == "ShapeMismatchError"
    assert "boundary stage 0 -> stage 1, activation of micro-batch 1" in message
    assert "tensor 0 is [2, 5, 8] float64, requires grad instead of [2, 3, 8]" in message
    assert "not their values" in message
    # Rank 0 told rank 1 (which would otherwise have waited for the activation until its
    # timeout, and said so in a PeerTimeoutError).
    kind, message = second["error"]
    assert kind == "PeerStepFailedError" and "ShapeMismatchError" in message
    assert message.startswith("rank 1: rank 0 failed at 0F1 (stage 0, micro-batch(es) 1)")
    # The pipeline goes on.
    model = torch.nn.Sequential(*build_value_dependent())
    ids, targets = value_dependent_batch(2, 2)
    loss = float(F.cross_entropy(model(ids), targets).detach())
    assert first["loss after"] == pytest.approx(loss, abs=TOL)


def test_data_parallel_copies_of_different_sizes_give_the_global_mean():
    results = launch(data_parallel_session, 4, TIMEOUT, threads_per_rank=1, timeout=300)
    for label, loss in (("mean", mean_loss), ("sum and count", token_mean)):
        expected = reference(DP_SHAPES, loss, padded=label != "mean")
        # Each copy holds every gradient: compare copy 0 and copy 1 alike.
        for copy in (results[:2], results[2:]):
            _compare(copy, label, expected)


def test_sharded_parameters_follow_shapes_that_change():
    # shard_parameters=True with 2BP: each step gathers the weights whatever the batch's
    # shapes; parts of uneven size give the global mean; AdamW steps the shards.
    schedules = ["1f1b", "zb-h1"]
    results = launch(sharded_session, 4, schedules, TIMEOUT, threads_per_rank=1, timeout=300)
    expected = trained_reference(DP_SHAPES)
    for name in schedules:
        for copy in (results[:2], results[2:]):
            for step, loss in enumerate(expected["losses"]):
                state: dict[str, torch.Tensor] = {}
                for rank in copy:
                    assert rank[name]["losses"][step] == pytest.approx(loss, abs=TOL), name
                    state.update(rank[name]["states"][step])
                assert state.keys() == expected["states"][step].keys()
                for key, value in expected["states"][step].items():
                    torch.testing.assert_close(
                        state[key], value, rtol=0, atol=TOL, msg=f"{name} {step} {key}"
                    )


# -- the pure parts ------------------------------------------------------------------


def test_the_layout_cache_keeps_the_most_recent_signatures():
    decider, other = LayoutCache(2), LayoutCache(2)

    def step(signature: str) -> tuple[int, bool]:
        code = decider.propose(signature)
        mine, theirs = decider.settle(code, signature), other.settle(code)
        mine[(0, 1)] = theirs[(0, 1)] = signature  # type: ignore[assignment]
        return code, decider.learns(code)

    assert step("a") == (3, True) and step("b") == (4, True)
    assert step("a") == (1, False) and step("b") == (2, False)
    # "c" takes the slot of the least recently used, "b"; "a" stays known.
    assert step("a") == (1, False)
    assert step("c") == (4, True)
    assert step("a") == (1, False) and step("b")[1] is True
    assert other.settle(1) == {(0, 1): "a"}
    # A failed step's slot is forgotten on every rank: its signature is learnt again.
    decider.forget(1)
    other.forget(1)
    assert step("a") == (3, True) and other.settle(1) == {(0, 1): "a"}
    with pytest.raises(ValueError, match="1 to 15"):
        LayoutCache(LAYOUT_SLOTS + 1)


@pytest.mark.parametrize(
    "info",
    [
        CallInfo(True, 63, OVERFLOW, 2 * LAYOUT_SLOTS),
        CallInfo(False, 0, 0),
        CallInfo(True, 5, 9, 2),
    ],
)
def test_call_info_fits_in_the_small_number(info):
    packed = info.pack()
    assert 0 <= packed < 2**SMALL_BITS
    assert CallInfo.unpack(packed) == info
    assert CallInfo.unpack(CallInfo(True, 1, OVERFLOW + 10).pack()).size == OVERFLOW
