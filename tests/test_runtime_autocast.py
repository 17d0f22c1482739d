"""Pipeline(..., autocast=dtype): every stage's forward under torch.autocast, one switch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime_models import build_blocks, loss_fn, make_batch, needs_no_process_group
from runtime_workers import WeightProducts
from twobp.runtime import Pipeline, PipelineConfigError

N_MB = 4

pytestmark = [needs_no_process_group, pytest.mark.usefixtures("torch_one_thread")]


def _float32_blocks() -> list[nn.Module]:
    return [b.float() for b in build_blocks("mlp")]


@pytest.mark.parametrize(
    ("two_bp", "recompute"),
    [(False, None), (True, None), (False, "activations"), (True, "all")],
)
def test_bf16_autocast_pipeline_matches_autocast_autograd(two_bp, recompute):
    # Recomputed forwards run under autocast as the first ones did: the same numbers.
    inputs, targets = (t.float() for t in make_batch("mlp", 0, 2 * N_MB))
    blocks = _float32_blocks()
    pipe = Pipeline(
        blocks,
        loss_fn("mlp"),
        "1f1b",
        N_MB,
        two_bp=two_bp,
        device="cpu",
        autocast=torch.bfloat16,
        recompute=recompute,
    )
    weight_shapes = {tuple(p.shape) for p in pipe.parameters() if p.dim() == 2}
    with WeightProducts(weight_shapes) as products:
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
    # Without 2BP the pipeline runs what autograd runs, micro-batch by micro-batch: the
    # same numbers. With it, W sums the micro-batches' products in one bfloat16 product
    # (about 0.005 apart here; the forward without autocast is 0.024 away).
    tolerance = 1e-2 if two_bp else 0.0
    for name, p in pipe.named_parameters():
        assert p.grad.dtype is torch.float32  # float32 master weights
        want_grad = grads[name].grad
        error = (p.grad - want_grad).norm() / max(want_grad.norm(), 1e-3 * total)
        assert error <= tolerance, (name, float(error))
    assert loss == want_loss  # the forward is the same either way
    # Every weight-gradient product ran in autocast's dtype; with 2BP, one per linear
    # layer over the 4 micro-batches (8 rows: the one stage's W0-3).
    assert products.dtypes and set(products.dtypes) == {torch.bfloat16}
    if two_bp:
        assert set(products.rows) == {2 * N_MB}
    assert pipe.eval_step(inputs).dtype is torch.bfloat16  # the last Linear ran under autocast


def test_autocast_with_a_dtype_the_device_cannot_run_is_refused():
    with pytest.raises(PipelineConfigError, match=r"rank 0: autocast=torch\.float64: .*bfloat16"):
        Pipeline(
            _float32_blocks(), loss_fn("mlp"), "1f1b", N_MB, device="cpu", autocast=torch.float64
        )
