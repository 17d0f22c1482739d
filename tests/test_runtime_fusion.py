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


def _fused(text: str, placement: tuple[int, ...] = (0,), out_of_groups: bool = False) -> str:
    """Rank 0's actions after the pass (other ranks, if any, have none)."""
    ranks = {r: [] for r in set(placement)}
    schedule = Schedule(placement, 8, {**ranks, 0: _actions(text)})
    fused = fuse_first_stage_backward(schedule, out_of_groups=out_of_groups)
    return " ".join(map(str, fused.actions[0]))


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


def test_out_of_groups_the_first_stages_cool_down_runs_b():
    actions = "0F0 0F1 0F2 0F3 0I0 0F4 0I1 0I2 0I3 0I4 0W0-4"
    assert _fused(actions) == actions
    assert _fused(actions, out_of_groups=True) == "0F0 0F1 0F2 0F3 0I0 0F4 0B1 0B2 0B3 0B4 0W0"
    # all of a W's micro-batches fused: the W goes
    assert _fused("0F0 0F1 0I0 0I1 0W0-1", out_of_groups=True) == "0F0 0F1 0B0 0B1"
    # an I before the cool-down keeps its W; a W of another stage ends the cool-down
    placement = (0, 1, 1, 0)
    assert _fused("0F0 3F0 0I0 3I0 3W0 0W0", placement, True) == "0F0 3F0 0I0 3I0 3W0 0W0"
    assert _fused("3F0 3I0 3W0", placement, True) == "3F0 3I0 3W0"  # not a first stage
    assert _fused("", out_of_groups=True) == ""


def test_the_dynamic_policy_fuses_the_first_stages_cool_down():
    from twobp.schedule.prepare import prepare

    def rank0(policy: str, m: int, schedule: str = "1f1b") -> str:
        prepared = prepare(schedule, n_ranks=2, n_microbatches=m, policy=policy)
        return " ".join(map(str, prepared.actions[0]))

    # m = p: the first stage runs what the static policies run
    assert rank0("dynamic", 2) == rank0("fill", 2) == "0F0 0F1 0B0 0B1"
    assert rank0("dynamic", 4) == "0F0 0F1 0I0 0F2 0I1 0F3 0B2 0B3 0W0-1"
    # the static policies keep their W where the cost model's concatenation put them
    assert rank0("paper", 4).endswith("0I3 0W1-3")
    assert rank0("paper", 4, "gpipe").endswith("0I3 0W0-3")


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
