"""The boundary layouts a pipeline keeps by input signature, when only dtype or grad flag change.

Steps on 2 gloo ranks whose inputs keep their shape but change, one at a time,
their dtype (float64, float32) or ``requires_grad``, and come back to
signatures seen before, must each equal plain PyTorch on that step: loss,
every parameter's gradient and the input's. A signature seen before sends no
layout message, a new one learns its layouts afresh (see
:mod:`twobp.runtime.communication.layout_cache`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from layout_cache_workers import CONFIGS, STEPS, reference, run_configs
from twobp.runtime import launch

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch(run_configs, 2, timeout=300)


def _tolerance(step: int) -> float:
    """Float64 steps match to rounding; float32 ones to float32's, in another order of sums."""
    return 1e-12 if STEPS[step][0] is torch.float64 else 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    gap = float((got - want).abs().max())
    assert gap <= tol * (1 + float(want.abs().max())), (what, gap)


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_each_step_equals_plain_torch_as_dtype_and_grad_flag_change(
    ranks: list[dict[str, Any]], config: tuple[Any, ...]
) -> None:
    for step, want in enumerate(reference()):
        tol = _tolerance(step)
        got = [rank[repr(config)][step] for rank in ranks]
        for rank in got:
            assert rank["loss"] == pytest.approx(want["loss"], rel=tol), step
        grads = {**got[0]["grads"], **got[1]["grads"]}
        assert grads.keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            _close(grads[name], grad, tol, f"step {step} {name}")
        # The input reaches the first stage, on rank 0.
        if want["input grad"] is None:
            assert got[0]["input grad"] is None, step
        else:
            assert got[0]["input grad"].dtype == want["input grad"].dtype
            _close(got[0]["input grad"], want["input grad"], tol, f"step {step} input")


@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_a_signature_seen_before_sends_no_layout_message(
    ranks: list[dict[str, Any]], config: tuple[Any, ...]
) -> None:
    seen: set[tuple[torch.dtype, bool]] = set()
    for step, signature in enumerate(STEPS):
        counts = [rank[repr(config)][step]["messages"] for rank in ranks]
        if signature in seen:
            assert counts == [0, 0], (step, signature, counts)
        else:
            assert all(c > 0 for c in counts), (step, signature, counts)
        seen.add(signature)
