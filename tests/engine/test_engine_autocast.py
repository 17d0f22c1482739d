"""Mixed precision: under torch.autocast (bf16, fp16) and with bf16 parameters, F, I and W run in
the dtypes autocast would use, and W accumulates into each parameter's own dtype.

Gradients are compared with plain autograd under the same autocast, per parameter, against the
larger of its own gradient's norm and 1e-3 of the whole gradient's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.engine import defer_weight_grads
from twobp.engine.autocast import check_autocast_dtype

BF16_TOL = 2e-2

# The reference's own F.rms_norm on a bf16 input with a float32 weight says it takes a slower path.
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")


class Mixed(nn.Module):
    """Every covered operation family, the norms included, and an elementwise gate."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 16)
        self.w = nn.Parameter(torch.randn(16, 8) * 0.3)  # GPT-2 style: torch.addmm
        self.b = nn.Parameter(torch.randn(8) * 0.1)
        self.rms = nn.RMSNorm(8)
        self.left = nn.Parameter(torch.randn(6, 5) * 0.3)  # Mamba style: P @ x
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.bn = nn.BatchNorm1d(8)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.ln(self.emb(tokens))  # (B, 5, 8)
        h = torch.tanh(self.lin(h))
        h = torch.addmm(self.b, h.reshape(-1, 16), self.w).reshape(tokens.shape[0], 5, 8)
        h = self.left @ self.rms(h)  # (B, 6, 8)
        h = self.bn(self.gn(self.conv(h.transpose(1, 2))))  # (B, 8, 6)
        return (h * self.gate).float().square().mean()


def relative_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per parameter: |g - g_ref| / max(|g_ref|, 1e-3 |G_ref|), G the whole gradient."""
    grads = [q.grad.double() for q in reference.parameters() if q.grad is not None]
    total = torch.cat([g.flatten() for g in grads]).norm()
    errors = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            diff = (p.grad.double() - q.grad.double()).norm()
            errors[name] = (diff / max(q.grad.double().norm(), 1e-3 * total)).item()
    return errors


def _run(model: nn.Module, dtype: torch.dtype | None, n: int = 3):
    """n micro-batches through the engine (F of all, I of all, one W) and through plain autograd."""
    reference = copy.deepcopy(model)
    store = defer_weight_grads(model)
    tokens = [
        torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(i)) for i in range(n)
    ]
    cast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    for mb, t in enumerate(tokens):
        with cast:
            reference(t).backward()
        with cast, store.forward(mb):
            loss = model(t)
        store.backward_input(mb, [loss], [None], [])
    stashed = store._stash  # what W will read
    dtypes = {t.dtype for entries in stashed[0].values() for e in entries for t in e.tensors}
    store.backward_weight(range(n))
    store.finish_step()
    return store, dtypes, relative_errors(model, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_is_deferred_in_its_dtypes_with_float32_master_gradients(dtype):
    torch.manual_seed(0)
    store, stash_dtypes, errors = _run(Mixed(), dtype)
    assert max(errors.values()) <= BF16_TOL, errors
    # The products ran in the lower precision, and their stash is kept in it; the
    # gradients accumulated into float32, the parameters' own dtype.
    assert dtype in stash_dtypes
    assert all(p.grad.dtype == torch.float32 for p in store._module.parameters())
    assert [n for n, _ in store.immediate_parameters()] == ["gate"]


CALLS = {
    "linear": (lambda m, x: F.linear(x, m.w2), (4, 6)),
    "addmm": (lambda m, x: torch.addmm(m.b4, x, m.w2.t()), (4, 6)),
    "matmul left": (lambda m, x: m.w2 @ x.t(), (4, 6)),
    "bmm": (lambda m, x: torch.bmm(x.unsqueeze(0), m.w2.t().unsqueeze(0)), (4, 6)),
    "conv1d": (lambda m, x: F.conv1d(x, m.w3), (2, 6, 5)),
    "embedding": (lambda m, x: F.embedding(x.long().abs() % 4, m.w2), (4, 6)),
    "layer_norm": (lambda m, x: F.layer_norm(x, (6,), m.g6, m.b6), (4, 6)),
    "rms_norm": (lambda m, x: F.rms_norm(x, (6,), m.g6), (4, 6)),
    "group_norm": (lambda m, x: F.group_norm(x, 2, m.g6, m.b6), (4, 6, 3)),
    "batch_norm": (lambda m, x: F.batch_norm(x, None, None, m.g6, m.b6, True), (4, 6)),
}


class Operands(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w2 = nn.Parameter(torch.randn(4, 6))
        self.w3 = nn.Parameter(torch.randn(3, 6, 2))
        self.b4 = nn.Parameter(torch.randn(4))
        self.g6 = nn.Parameter(torch.randn(6))
        self.b6 = nn.Parameter(torch.randn(6))


@pytest.mark.parametrize("lower_input", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CALLS))
def test_each_operation_runs_in_the_dtype_autocast_gives_it(name, dtype, lower_input):
    call, shape = CALLS[name]
    module = Operands()
    store = defer_weight_grads(module)
    x = torch.randn(*shape, dtype=dtype if lower_input else torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        want = call(module, x)
        with store.forward(0):
            got = call(module, x)
    assert type(got.grad_fn).__name__ == "DeferredWeightFunctionBackward"
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    store.backward_input(0, [got], [torch.ones_like(got)], [x])
    store.backward_weight([0])
    store.finish_step()


def test_autocast_deferred_ops_are_split_functions_with_lower_precision_outputs():
    model = nn.Sequential(nn.Linear(4, 4))
    store = defer_weight_grads(model)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), store.forward(0):
        y = model(x)
    assert y.dtype is torch.bfloat16
    assert type(y.grad_fn).__name__ == "DeferredWeightFunctionBackward"
    (dx,) = store.backward_input(0, [y], [torch.ones_like(y)], [x])
    assert dx.dtype is torch.float32  # back in the input's dtype
    assert model[0].weight.grad is None  # waits for W
    store.backward_weight([0])
    assert model[0].weight.grad.dtype is torch.float32
    store.finish_step()


def test_pure_bfloat16_model():
    torch.manual_seed(0)
    store, stash_dtypes, errors = _run(Mixed().to(torch.bfloat16), None)
    assert max(errors.values()) <= BF16_TOL, errors
    assert stash_dtypes == {torch.bfloat16, torch.int64}
    assert all(p.grad.dtype == torch.bfloat16 for p in store._module.parameters())


def test_weight_cast_by_the_model_is_followed():
    class CastsItsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 4)

        def forward(self, x: Tensor) -> Tensor:
            w = self.proj.weight.to(torch.bfloat16)
            return F.linear(x.to(torch.bfloat16), w, self.proj.bias.bfloat16()).float().sum()

    torch.manual_seed(0)
    model = CastsItsWeight()
    reference = copy.deepcopy(model)
    store = defer_weight_grads(model)
    for mb in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(mb))
        reference(x).backward()
        with store.forward(mb):
            loss = model(x)
        store.backward_input(mb, [loss], [None], [])
    store.backward_weight(range(3))
    store.finish_step()
    assert store.immediate_parameters() == []
    assert model.proj.weight.grad.dtype is torch.float32
    assert max(relative_errors(model, reference).values()) <= BF16_TOL


def test_autocast_dtype_the_device_cannot_run_is_refused():
    check_autocast_dtype(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"takes torch\.bfloat16 or torch\.float16"):
        check_autocast_dtype(torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match="not available on device type 'meta'"):
        check_autocast_dtype(torch.device("meta"), torch.bfloat16)


WIDE_CALLS = {name: CALLS[name] for name in ("linear", "addmm", "matmul left", "bmm", "conv1d")}


@pytest.mark.parametrize("name", list(WIDE_CALLS))
def test_a_float16_weight_gradient_concatenated_over_micro_batches_does_not_overflow(name):
    """Each micro-batch's float16 weight gradient is finite (about 30000, below 65504) but
    four of them sum to about 120000: W over all four gives that sum, as four separate
    passes into the float32 .grad would, not infinity."""
    call, shape = WIDE_CALLS[name]
    module, reference = Operands(), Operands()
    with torch.no_grad():
        for p, q in zip(module.parameters(), reference.parameters(), strict=True):
            p.fill_(0.01)
            q.fill_(0.01)
    store = defer_weight_grads(module)
    n = 4
    xs = [torch.full(shape, 60.0) for _ in range(n)]
    for mb, x in enumerate(xs):
        with torch.autocast("cpu", dtype=torch.float16):
            want = call(reference, x)
            with store.forward(mb):
                got = call(module, x)
        seed = torch.full_like(got, 500.0 / (x.numel() // shape[-1]))
        want.backward(seed)
        store.backward_input(mb, [got], [seed], [])
    store.backward_weight(range(n))
    store.finish_step()
    for (label, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            continue
        assert torch.isfinite(q.grad).all(), label
        if label in ("w2", "w3"):
            assert q.grad.abs().max() > 65504, label
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=0)
