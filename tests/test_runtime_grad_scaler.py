"""Loss scaling for float16 (``twobp.GradScaler``) on real gloo ranks: 2 stages x 2 copies.

One launched session runs every distributed case:

* a model whose first block's gradients overflow float16 at large scales (and no other
  gradient does): every rank skips the same steps and holds the same scale, the
  overflow shows only on the ranks of that block, then training settles and the loss falls;
* without overflow, a scale that grows every two steps: the scales, the global norms after
  ``unscale_`` and the parameters match one process on the whole batch with
  ``torch.amp.GradScaler("cpu")`` under float16 autocast, within float16 tolerance;
* a loss that is NaN itself still raises ``NonFiniteLossError`` (``nonfinite="raise"``);
* the same with ``pipe.shard_optimizer`` (ZeRO-1): the same scales, norms and parameters.

The rest runs in this process (a one-rank pipeline): torch's API, its errors and its state.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twobp
from grad_scaler_workers import N_MB, PART, build_blocks, make_batch, overflow, parity
from twobp.runtime import GradScaler, Pipeline, PipelineConfigError, launch

pytestmark = pytest.mark.usefixtures("torch_one_thread")

OVERFLOW_STEPS = 14
PARITY_STEPS = 6
PARITY_LR = 0.2
PARITY_SCALER = {"init_scale": 2.0**8, "growth_interval": 2}


def _session() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return (
        overflow(OVERFLOW_STEPS),
        parity(PARITY_STEPS, PARITY_LR, PARITY_SCALER),
        parity(PARITY_STEPS, PARITY_LR, PARITY_SCALER, sharded=True),
    )


@pytest.fixture(scope="module")
def ranks() -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    return launch(_session, 4, timeout=600)


def test_every_rank_skips_the_same_overflowing_steps_then_the_loss_falls(ranks):
    runs = [run for run, _, _ in ranks]
    first = runs[0]
    for run in runs[1:]:
        assert run["skipped"] == first["skipped"]
        assert run["scales"] == first["scales"]
        assert run["losses"] == first["losses"]
    skipped = [step for step, s in enumerate(first["skipped"]) if s]
    # The scale halves from 2**16 until the first block's gradients fit float16.
    assert skipped == list(range(len(skipped))) and 2 <= len(skipped) < OVERFLOW_STEPS - 6
    assert first["scales"][: len(skipped)] == [2.0 ** (15 - s) for s in skipped]
    # Only the ranks of the first block saw an overflow (both copies: their gradients are
    # all-reduced); the other pipeline rank skipped on the agreement alone.
    for rank, run in enumerate(runs):
        seen = {n for names in run["not_finite"] for n in names}
        if rank % 2 == 0:
            assert seen and all(n.startswith("0.") for n in seen), seen
            assert all(run["not_finite"][s] for s in skipped)
        else:
            assert not seen
    losses = first["losses"]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * losses[len(skipped)]


def _reference() -> dict[str, Any]:
    """One process, the whole batch, torch.amp.GradScaler under float16 autocast."""
    model = nn.Sequential(*build_blocks(False))
    optimizer = torch.optim.SGD(model.parameters(), lr=PARITY_LR)
    scaler = torch.amp.GradScaler("cpu", **PARITY_SCALER)
    losses, scales, norms = [], [], []
    for step in range(PARITY_STEPS):
        x, y = make_batch(step, 2 * PART)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
    return {"losses": losses, "scales": scales, "norms": norms, "state": model.state_dict()}


def test_without_overflow_the_pipeline_matches_torch_grad_scaler_on_one_process(ranks):
    want = _reference()
    runs = [run for _, run, _ in ranks]
    assert want["scales"] == [256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0]
    state: dict[str, torch.Tensor] = {}
    for run in runs:
        assert run["scales"] == want["scales"]
        assert not any(run["skipped"])
        assert run["losses"] == pytest.approx(want["losses"], rel=2e-3)
        # The global norm of the unscaled gradients, on every rank.
        assert run["norms"] == pytest.approx(want["norms"], rel=2e-3)
        state.update(run["state"])
    assert state.keys() == want["state"].keys()
    for name, value in want["state"].items():
        torch.testing.assert_close(state[name], value, rtol=2e-3, atol=2e-4, msg=name)


def test_a_loss_that_is_not_finite_itself_still_follows_nonfinite(ranks):
    assert [run["nonfinite"] for _, run, _ in ranks] == ["NonFiniteLossError"] * 4


def test_a_sharded_optimizer_steps_and_skips_as_the_plain_one(ranks):
    """pipe.shard_optimizer (ZeRO-1): the scaler unscales and checks the optimizer's own
    gradients, this rank's shards of the reduced ones; the run is the plain optimizer's."""
    for _, plain, sharded in ranks:
        assert sharded["scales"] == plain["scales"]
        assert sharded["skipped"] == plain["skipped"]
        assert sharded["norms"] == pytest.approx(plain["norms"], rel=1e-6)
        assert sharded["nonfinite"] == "NonFiniteLossError"
        for name, value in plain["state"].items():
            torch.testing.assert_close(sharded["state"][name], value, rtol=1e-6, atol=1e-7)


# -- in this process ------------------------------------------------------------------------


def _single(scaler: Any, **options: Any) -> Pipeline:
    return Pipeline(
        build_blocks(False),
        F.mse_loss,
        n_microbatches=N_MB,
        device="cpu",
        autocast=torch.float16,
        grad_scaler=scaler,
        **options,
    )


def test_grad_scaler_has_torch_s_arguments_methods_and_state():
    assert twobp.GradScaler is GradScaler
    ours = GradScaler("cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25,
                      growth_interval=3)  # fmt: skip
    theirs = torch.amp.GradScaler("cpu", 8.0, 4.0, 0.25, 3)
    assert ours.state_dict() == theirs.state_dict()
    assert ours.get_scale() == 8.0 and ours.is_enabled()
    assert ours.get_growth_factor() == 4.0 and ours.get_backoff_factor() == 0.25
    assert ours.get_growth_interval() == 3
    loss = torch.tensor(1.5)
    assert float(ours.scale(loss)) == 12.0
    assert [float(t) for t in ours.scale([loss, loss])] == [12.0, 12.0]
    other = GradScaler()
    other.load_state_dict(theirs.state_dict())
    assert other.state_dict() == theirs.state_dict()
    off = GradScaler(enabled=False)
    assert off.state_dict() == {} and off.get_scale() == 1.0 and off.scale(loss) is loss
    with pytest.raises(RuntimeError, match="source state dict is empty"):
        other.load_state_dict(off.state_dict())
    with pytest.raises(ValueError, match=r"backoff_factor=1\.5"):
        GradScaler(backoff_factor=1.5)


def test_the_pipeline_scales_its_losses_and_the_scaler_keeps_torch_s_order():
    scaler = GradScaler(init_scale=2.0**10)
    optimizer_of = lambda pipe: torch.optim.SGD(pipe.parameters(), lr=0.1)  # noqa: E731
    x, y = make_batch(0, PART)
    plain = _single(None)
    plain_loss = plain.step(x, y)
    plain_grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain.close()
    pipe = _single(scaler)
    optimizer = optimizer_of(pipe)
    assert pipe.step(x, y) == pytest.approx(plain_loss, rel=1e-6)  # unscaled
    for name, p in pipe.named_parameters():  # the gradients are scaled
        torch.testing.assert_close(p.grad, plain_grads[name] * 2.0**10, rtol=2e-3, atol=1e-3)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match="No inf checks were recorded"):
        scaler.update()
    # One pipeline at a time; after close() the scaler may serve another.
    with pytest.raises(PipelineConfigError, match="belongs to another open pipeline"):
        _single(scaler)
    pipe.close()
    _single(scaler).close()


def test_a_scaler_the_pipeline_cannot_agree_with_is_refused():
    with pytest.raises(PipelineConfigError, match=r"use twobp\.GradScaler"):
        _single(torch.amp.GradScaler("cpu"))
    with pytest.raises(PipelineConfigError, match=r"must be a twobp\.GradScaler"):
        _single(2.0**16)
    alone = GradScaler()
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters())
    with pytest.raises(RuntimeError, match="not given to a pipeline"):
        alone.step(optimizer)
