"""Pipeline(..., autocast=dtype): every stage's forward under torch.autocast, one switch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime_models import build_blocks, loss_fn, make_batch, needs_no_process_group
from twobp.runtime import Pipeline, PipelineConfigError

N_MB = 4

pytestmark = [needs_no_process_group, pytest.mark.usefixtures("torch_one_thread")]


def _float32_blocks() -> list[nn.Module]:
    return [b.float() for b in build_blocks("mlp")]


@pytest.mark.parametrize("two_bp", [False, True])
def test_bf16_autocast_pipeline_matches_autocast_autograd(two_bp):
    inputs, targets = (t.float() for t in make_batch("mlp", 0, 2 * N_MB))
    pipe = Pipeline(
        _float32_blocks(),
        loss_fn("mlp"),
        "1f1b",
        N_MB,
        two_bp=two_bp,
        device="cpu",
        autocast=torch.bfloat16,
    )
    loss = pipe.step(inputs, targets)
    reference = nn.Sequential(*_float32_blocks())
    want_loss = 0.0
    for x, y in zip(inputs.chunk(N_MB), targets.chunk(N_MB), strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            part = loss_fn("mlp")(reference(x), y) / N_MB
        part.backward()
        want_loss += float(part.detach())
    grads = dict(reference.named_parameters())
    total = torch.cat([p.grad.flatten() for p in grads.values()]).norm()
    for name, p in pipe.named_parameters():
        assert p.grad.dtype is torch.float32  # float32 master weights
        want_grad = grads[name].grad
        error = (p.grad - want_grad).norm() / max(want_grad.norm(), 1e-3 * total)
        assert error <= 2e-2, (name, float(error))
    assert loss == pytest.approx(want_loss, rel=2e-2)
    assert pipe.eval_step(inputs).dtype is torch.bfloat16  # the last Linear ran under autocast


def test_autocast_with_a_dtype_the_device_cannot_run_is_refused():
    with pytest.raises(PipelineConfigError, match=r"rank 0: autocast=torch\.float64: .*bfloat16"):
        Pipeline(
            _float32_blocks(), loss_fn("mlp"), "1f1b", N_MB, device="cpu", autocast=torch.float64
        )
