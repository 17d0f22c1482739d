"""Bad input raises the same clear error on every rank, before any work is lost.

One launch of 2 ranks (gloo, CPU) tries each bad input in turn; every rank
records what it raised. Errors in the middle of a step cannot be announced to
a peer that waits on a transfer: the peer times out naming the rank, or, when
the failing rank's process ends, fails at once with ``PeerFailedError``. The
session ends with such a fatal error.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from reliability_workers import BATCH, FATAL_TIMEOUT, N_MB, bad_inputs_session
from runtime_models import build_blocks, make_batch, reference_step
from twobp.runtime import LaunchError, launch
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.step_start import CallInfo, check_same_call
from twobp.runtime.setup.fingerprint import BlockPrint, describe_difference

TIMEOUT = 30.0
TOL = 1e-10


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> tuple[list[dict[str, Any]], LaunchError]:
    folder = tmp_path_factory.mktemp("bad-inputs")
    with pytest.raises(LaunchError) as info:
        launch(
            bad_inputs_session, 2, str(folder), TIMEOUT, threads_per_rank=1,
            grace_period=FATAL_TIMEOUT + 10.0, timeout=180,
        )  # fmt: skip
    outcomes = [pickle.loads((Path(folder) / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    return outcomes, info.value


# (case, error class, a piece of the message every rank shows)
SAME_ON_EVERY_RANK = [
    ("unknown schedule", "PipelineConfigError", "unknown schedule '2f2b'"),
    ("unknown policy", "PipelineConfigError", "unknown 2BP policy 'sometimes'; use one of"),
    ("more stages than blocks", "PipelineConfigError", "has 1 blocks but the schedule has 2"),
    ("partition sum", "PipelineConfigError", "covers 6 blocks, but the model has 10"),
    ("too few micro-batches", "PipelineConfigError", "multiple of the number of ranks"),
    ("world size", "PipelineConfigError", "places its stages on 4 ranks, but the group has 2"),
    ("unknown nonfinite", "PipelineConfigError", "nonfinite='ignore'"),
    ("bad partition on one rank", "PipelineConfigError", "partition [5, 6] covers 11 blocks"),
    ("options differ", "ModelMismatchError", "blocks per stage [5, 5] on rank 0, [3, 7] on rank 1"),
    (
        "transfer options differ",
        "ModelMismatchError",
        "order_only_matching False on rank 0, True on rank 1",
    ),
    ("blocks differ", "ModelMismatchError", "block 4 differs between rank 0"),
    ("block count differs", "ModelMismatchError", "model of 10 blocks and rank 1 one of 11"),
    ("fewer rows than micro-batches", "PipelineConfigError", "batch size 3, fewer rows than the 4"),
    ("inputs missing", "PipelineConfigError", "rank 0 holds stage 0 and needs the inputs"),
    ("targets missing", "PipelineConfigError", "holds the last stage (1) and needs the targets"),
    (
        "batch sizes differ",
        "PipelineConfigError",
        "the inputs on rank 0 hold 8 samples but the targets on rank 1 hold 12",
    ),
    ("inputs not tensors", "PipelineConfigError", "must be a tensor or a tuple of tensors"),
    ("different calls", "PipelineConfigError", "rank 0 called step() but rank 1 called eval"),
    ("nan raise", "NonFiniteLossError", "micro-batch 2 was the first"),
]


@pytest.mark.parametrize(("case", "error", "text"), SAME_ON_EVERY_RANK, ids=lambda v: str(v))
def test_every_rank_raises_the_same_clear_error(session, case, error, text):
    outcomes = session[0]
    for rank, out in enumerate(outcomes):
        assert out[case] is not None, f"rank {rank} raised nothing for {case}"
        name, message = out[case]
        assert name == error, (rank, message)
        assert text in message, (rank, message)
        # Every message names a rank and says what to do.
        assert "rank" in message and any(
            w in message for w in ("use", "pass", "give", "start", "split", "must", "Lower")
        ), message


def test_a_problem_one_rank_sees_is_reported_by_it_on_the_others(session):
    outcomes = session[0]
    assert outcomes[0]["targets missing"][1].startswith("rank 1 reported: rank 1 holds")
    assert outcomes[1]["inputs missing"][1].startswith("rank 0 reported: rank 0 holds")
    assert outcomes[0]["bad partition on one rank"][1].startswith("rank 1 reported:")


def test_the_pipeline_stays_usable_after_bad_input(session):
    outcomes = session[0]
    model = nn.Sequential(*build_blocks("mlp"))
    inputs, targets = make_batch("mlp", 0, BATCH)
    want = reference_step(model, "mlp", inputs, targets, N_MB)
    for out in outcomes:
        assert math.isclose(out["usable after bad inputs"], want, rel_tol=0, abs_tol=TOL)
    grads = {**outcomes[0]["usable grads"], **outcomes[1]["usable grads"]}
    assert len(grads) == len(outcomes[0]["usable grads"]) + len(outcomes[1]["usable grads"])
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=TOL, msg=name)


def test_nonfinite_raise_drops_the_gradients_on_every_rank(session):
    for out in session[0]:
        assert all(out["nan raise grads"])


def test_nonfinite_skip_drops_the_step_and_goes_on(session):
    for out in session[0]:
        assert math.isinf(out["inf skip loss"])
        skipped, steps, no_grads = out["inf skip flags"]
        assert skipped and steps == [0] and all(no_grads)
        loss, skipped_again, count = out["after skip"]
        assert math.isfinite(loss) and not skipped_again and count == 2


def test_values_that_differ_only_warn_naming_the_block(session):
    for rank, out in enumerate(session[0]):
        (warning,) = out["values differ"]
        assert warning.startswith(f"rank {rank}: block 2 has other values on rank 1")
        assert "torch.manual_seed" in warning


def test_two_bp_off_merges_a_split_schedule(session):
    for out in session[0]:
        assert out["zb-h1 without 2BP"] == ["B", "F"]


def test_errors_in_the_middle_of_a_step_reach_the_peer_at_once(session):
    rank0, rank1 = session[0]
    name, message = rank1["non-scalar loss"]
    assert name == "ValueError" and "it must return a scalar" in message
    name, message = rank0["non-scalar loss"]
    assert name == "PeerStepFailedError"
    assert message.startswith("rank 0: rank 1 failed at 1F0 (stage 1, micro-batch(es) 0): ")
    assert "ValueError: loss_fn returned tensors of shapes" in message
    # Rank 1 told rank 0 (which would otherwise have waited for the gradient until its
    # timeout, and said so in a PeerTimeoutError).
    name, message = rank0["dtype change"]
    assert name == "ShapeMismatchError"
    assert "[2, 8] float32, requires grad instead of [2, 8] float64" in message
    name, message = rank1["dtype change"]
    assert name == "PeerStepFailedError" and "rank 0 failed at 0F0" in message
    assert "ShapeMismatchError" in message


def test_a_rank_that_raises_ends_the_others_at_once(session):
    _, error = session
    first, second = error.failures
    assert first.rank == 1 and first.error_type == "RuntimeError"
    assert "block 9 failed on purpose" in first.message
    assert second.rank == 0 and second.error_type == "PeerStepFailedError"
    assert second.peer == 1
    assert second.message.startswith("rank 0: rank 1 failed at 1F0 (stage 1, micro-batch(es) 0)")
    assert str(error).startswith("2 of 2 processes failed; the first was rank 1")
    # Rank 0 learnt of rank 1's failure from rank 1 (PeerStepFailedError, above), not by
    # waiting out its timeout (a PeerTimeoutError).


# -- the pure parts, without processes -------------------------------------------------


def test_check_same_call_names_what_differs():
    check_same_call([CallInfo(True, 3, 8), CallInfo(True, 3, 8)])
    with pytest.raises(PipelineConfigError, match=r"rank 0 is at step 3 but rank 1 at step 2"):
        check_same_call([CallInfo(True, 3, 8), CallInfo(True, 2, 8)])
    with pytest.raises(PipelineConfigError, match=r"rank 0 holds 8 samples.*rank 2 holds 4"):
        calls = [CallInfo(True, 0, 8), CallInfo(True, 0, 0), CallInfo(True, 0, 4)]
        check_same_call(calls)
    # Inputs on one rank, targets on another: the message says which is which.
    with pytest.raises(PipelineConfigError, match=r"inputs on rank 0 hold 8 .* targets on rank 1"):
        check_same_call([CallInfo(True, 0, 8), CallInfo(True, 0, 12)], [((0,), (1,))])
    # A rank holding no batch says 0, and is not compared.
    check_same_call([CallInfo(False, 0, 8), CallInfo(False, 0, 0)])


def test_describe_difference_reports_structure_before_options():
    a, b = BlockPrint(1, 1, "Linear with 9 parameters"), BlockPrint(2, 1, "Linear with 4")
    same = {"schedule": "1f1b"}
    assert describe_difference([(2, same, [a, a]), (2, same, [a, a])]) is None
    text = describe_difference([(2, same, [a, a]), (2, {"schedule": "gpipe"}, [a, b])])
    assert text is not None and text.startswith("block 1 differs between rank 0 (Linear with 9")
    text = describe_difference([(2, same, [a, a]), (2, {"schedule": "gpipe"}, [a, a])])
    assert text is not None and "schedule 1f1b on rank 0, gpipe on rank 1" in text


def test_twobp_train_stops_after_too_many_skipped_steps_in_a_row():
    from twobp.runtime.errors import NonFiniteLossError
    from twobp.train.loop import MAX_SKIPPED_IN_A_ROW, _check_skipped_in_a_row

    in_a_row = list(range(3, 3 + MAX_SKIPPED_IN_A_ROW))
    _check_skipped_in_a_row(in_a_row[:-1], rank=0)
    _check_skipped_in_a_row([0, *in_a_row[1:], 100], rank=0)  # gaps: go on
    with pytest.raises(NonFiniteLossError, match=r"10 steps in a row \(3 to 12\)"):
        _check_skipped_in_a_row(in_a_row, rank=1)
