"""An I directly followed by its own W on the first stage runs as one B."""

from __future__ import annotations

import pytest
import torch

from runtime_models import (
    build_blocks,
    loss_fn,
    make_batch,
    needs_no_process_group,
    one_thread,
    train_reference,
)
from runtime_workers import Case, train_case
from twobp.runtime import Pipeline
from twobp.schedule import Schedule, fuse_first_stage_backward
from twobp.schedule.action import Action

N_MB = 4
TOL = 1e-10


def _actions(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


def _fused(text: str, placement: tuple[int, ...] = (0,)) -> str:
    """Rank 0's actions after the pass (other ranks, if any, have none)."""
    ranks = {r: [] for r in set(placement)}
    schedule = Schedule(placement, 4, {**ranks, 0: _actions(text)})
    return " ".join(map(str, fuse_first_stage_backward(schedule).actions[0]))


def test_pairs_of_the_first_stage_become_full_backwards():
    assert _fused("0F0 0F1 0I0 0W0 0I1 0W1") == "0F0 0F1 0B0 0B1"


def test_only_a_w_of_the_same_micro_batch_right_after_its_i_is_fused():
    actions = "0F0 0F1 0F2 0I0 0F3 0W0 0I1 0W2 0I2 0W1-2 0I3 0W3"
    assert _fused(actions) == "0F0 0F1 0F2 0I0 0F3 0W0 0I1 0W2 0I2 0W1-2 0B3"


def test_other_stages_keep_their_split():
    placement = (0, 1, 1, 0)
    assert _fused("3F0 3I0 3W0 0F0 0I0 0W0", placement) == "3F0 3I0 3W0 0F0 0B0"
    unchanged = Schedule(placement, 4, {0: _actions("3F0 3I0 3W0"), 1: []})
    assert fuse_first_stage_backward(unchanged) is unchanged


@needs_no_process_group
def test_fused_pairs_give_the_reference_gradients_and_show_as_b():
    with one_thread():
        reference = train_reference("transformer", N_MB, 2 * N_MB)
        result = train_case(
            Case("transformer", "1f1b", True, policy="eager"), N_MB, 2 * N_MB, timeout=5.0
        )
        assert result["losses"] == pytest.approx(reference["losses"], abs=TOL, rel=0)
        for name, want in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], want, rtol=0, atol=TOL)
        for name, want in reference["state"].items():
            torch.testing.assert_close(result["state"][name], want, rtol=0, atol=TOL)

        pipe = Pipeline(
            build_blocks("mlp"),
            loss_fn("mlp"),
            schedule="1f1b",
            n_microbatches=N_MB,
            two_bp_policy="eager",
            device="cpu",
        )
        pipe.step(*make_batch("mlp", 0, 2 * N_MB))
        assert " ".join(str(s.action) for s in pipe.timeline()) == (
            "0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3"
        )
        assert pipe.peak_stashed_bytes() == 0
