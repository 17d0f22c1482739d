"""Each covered layer type alone: 2BP gradients equal plain autograd's (float64)."""

from __future__ import annotations

import pytest
import torch
from engine_harness import assert_matches, compare_with_autograd, plan_f_i_w, randn, seeded
from torch import nn

from twobp.engine import defer_weight_grads


def _x(*shape: int, grad: bool = True):
    return lambda mb: [(randn(*shape, seed=mb), grad)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 5), (5,)])
def test_linear(bias, shape):
    store = assert_matches(seeded(lambda: nn.Linear(5, 4, bias=bias)), _x(*shape))
    assert [n for n, _ in store.deferred_parameters()] == ["weight", "bias"][: 1 + bias]


def test_linear_first_layer_input_without_grad():
    assert_matches(seeded(lambda: nn.Linear(5, 4)), _x(3, 5, grad=False))


def test_linear_sequence_length_differs_between_microbatches():
    make_inputs = lambda mb: [(randn(2, 3 + mb, 5, seed=mb), True)]  # noqa: E731
    assert_matches(seeded(lambda: nn.Linear(5, 4)), make_inputs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"stride": 2, "padding": 1, "dilation": 2},
        {"groups": 2, "bias": False},
        {"padding": "same", "padding_mode": "reflect"},
        {"padding": 2, "padding_mode": "circular"},
        {"padding": 1, "padding_mode": "replicate"},
        {"padding": "valid"},
    ],
)
def test_conv1d(kwargs):
    assert_matches(seeded(lambda: nn.Conv1d(4, 6, 3, **kwargs)), _x(2, 4, 11))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"padding": 1},
        {"stride": (2, 1), "padding": (0, 2), "dilation": (1, 2)},
        {"padding": "same"},  # even kernel: asymmetric padding
        {"padding": "same", "padding_mode": "reflect"},
        {"groups": 2},
    ],
)
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d(kwargs):
    kernel = 2 if kwargs.get("padding") == "same" else 3
    assert_matches(seeded(lambda: nn.Conv2d(4, 6, kernel, **kwargs)), _x(2, 4, 7, 6))


@pytest.mark.parametrize("mode", ["circular", "replicate"])
def test_conv2d_and_conv3d_with_circular_and_replicate_padding(mode):
    # The module pads with F.pad itself; the deferred layer must pad alike in F and I.
    store = assert_matches(
        seeded(lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode=mode, stride=(1, 2))),
        _x(2, 3, 6, 7),
    )
    assert [n for n, _ in store.deferred_parameters()] == ["weight", "bias"]
    store = assert_matches(
        seeded(lambda: nn.Conv3d(2, 3, (3, 2, 3), padding=(1, 1, 2), padding_mode=mode)),
        _x(2, 2, 4, 5, 5),
        n=3,
    )
    assert [n for n, _ in store.deferred_parameters()] == ["weight", "bias"]


def test_conv2d_spatial_size_differs_between_microbatches():
    make_inputs = lambda mb: [(randn(2, 3, 5 + mb % 2, 6, seed=mb), True)]  # noqa: E731
    assert_matches(seeded(lambda: nn.Conv2d(3, 4, 3, padding=1)), make_inputs)


def test_conv2d_unbatched_input_and_conv3d():
    assert_matches(seeded(lambda: nn.Conv2d(3, 4, 3)), _x(3, 6, 5))
    assert_matches(seeded(lambda: nn.Conv3d(2, 3, 2, stride=2)), _x(2, 2, 4, 4, 5), n=3)


@pytest.mark.parametrize("padding_idx", [None, 0, 3])
def test_embedding(padding_idx):
    def make_inputs(mb):
        g = torch.Generator().manual_seed(mb)
        return [(torch.randint(0, 7, (3, 5), generator=g), False)]

    store = assert_matches(seeded(lambda: nn.Embedding(7, 4, padding_idx=padding_idx)), make_inputs)
    assert [n for n, _ in store.deferred_parameters()] == ["weight"]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"sparse": True}, "sparse"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
        ({"max_norm": 1.0}, "max_norm"),
    ],
)
def test_embedding_options_that_stay_immediate(kwargs, reason):
    def make_inputs(mb):
        return [(torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(mb)), False)]

    module = seeded(lambda: nn.Embedding(7, 4, **kwargs))()
    if kwargs.get("sparse"):
        store = defer_weight_grads(module)
    else:  # dense gradients: they must still be exact, through the immediate path
        schedule = plan_f_i_w(3, [("W", (0, 1, 2))])
        comparison, store = compare_with_autograd(module, make_inputs, schedule)
        assert comparison.worst() <= 1e-10, comparison
    assert store.deferred_parameters() == []
    assert [n for n, _ in store.immediate_parameters()] == ["weight"]
    assert reason in store.report()


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(6),
        lambda: nn.LayerNorm(6, bias=False),
        lambda: nn.LayerNorm((3, 6)),
    ],
)
def test_layer_norm(make):
    assert_matches(seeded(make), _x(2, 4, 3, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_equals_plain_autograd_to_the_bit(dtype, bias):
    """F, I and W of a LayerNorm run the kernels plain autograd runs (the forward through
    torch's own binding, the backward split by its output mask): the output and every
    gradient are plain autograd's, bit for bit, in the first forward (under the capture's
    torch function mode) and in a later one (through the parameters' class), with two
    micro-batches in one W."""
    plain = seeded(lambda: nn.LayerNorm((4, 6), eps=1e-3, bias=bias))().to(dtype)
    module = seeded(lambda: nn.LayerNorm((4, 6), eps=1e-3, bias=bias))().to(dtype)
    store = defer_weight_grads(module)
    xs = [randn(3, 4, 6, seed=mb).to(dtype) for mb in range(2)]
    dys = [randn(3, 4, 6, seed=9 + mb).to(dtype) for mb in range(2)]
    for step in range(2):
        outs, dxs, leaves = [], [], []
        for mb, x in enumerate(xs):
            leaf = x.detach().requires_grad_()
            with store.forward(mb):
                outs.append(module(leaf))
            leaves.append(leaf)
        for mb in range(2):
            dxs.append(store.backward_input(mb, [outs[mb]], [dys[mb]], [leaves[mb]])[0])
        store.backward_weight([0, 1])
        store.finish_step()
        for mb, x in enumerate(xs):
            leaf = x.detach().requires_grad_()
            out = plain(leaf)
            out.backward(dys[mb])
            assert torch.equal(out, outs[mb]), (step, mb)
            assert torch.equal(leaf.grad, dxs[mb]), (step, mb)
        for (name, p), q in zip(plain.named_parameters(), module.parameters(), strict=True):
            assert q.grad is not None and q.grad.dtype == dtype
            assert torch.equal(p.grad, q.grad), (step, name)
        plain.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)


def test_layer_norm_kernel_is_hidden_from_a_user_torch_function_mode():
    """A torch function mode of the user's around the forwards sees no kernel call of the
    engine's LayerNorm, in the first forward (under the capture's mode) or a later one."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    module = seeded(lambda: nn.LayerNorm(6))()
    store = defer_weight_grads(module)
    for _ in range(2):
        x = randn(2, 6, seed=0).requires_grad_()
        with Seen() as seen, store.forward(0):
            out = module(x)
        assert not [n for n in seen.names if "native" in n], seen.names
        store.backward_input(0, [out], [torch.ones_like(out)], [x])
        store.backward_weight([0])
        store.finish_step()


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm(eps):
    assert_matches(seeded(lambda: nn.RMSNorm(6, eps=eps)), _x(2, 4, 6))
    assert_matches(seeded(lambda: nn.RMSNorm((4, 6), eps=eps)), _x(2, 4, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_fused_forward_gives_what_the_written_one_gives(dtype, monkeypatch):
    """F of a float32 or float64 RMSNorm runs torch's fused kernel: the output, and the
    gradients of I and W, equal those of the norm written out, to the bit."""
    from twobp.engine.ops import norm

    fused = norm._fused_rms_norm
    if fused is None:
        pytest.skip("this torch has no torch._fused_rms_norm")
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return fused(*args)

    def run(fast):
        monkeypatch.setattr(norm, "_fused_rms_norm", counted if fast else None)
        module = seeded(lambda: nn.RMSNorm((4, 6), eps=1e-5))().to(dtype)
        store = defer_weight_grads(module)
        x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)
        x.requires_grad_()
        with store.forward(0):
            out = module(x)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
        (dx,) = store.backward_input(0, [out], [dy], [x])
        store.backward_weight([0])
        store.finish_step()
        return out.detach(), dx, module.weight.grad

    fast, written = run(True), run(False)
    assert calls == [1]
    for a, b in zip(fast, written, strict=True):
        assert a.dtype == dtype
        assert torch.equal(a, b)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm2d_training(momentum):
    # Running statistics are compared too: the patched forward must update them alike.
    assert_matches(seeded(lambda: nn.BatchNorm2d(3, momentum=momentum)), _x(4, 3, 5, 5), steps=2)


def test_batch_norm_eval_and_untracked_and_1d():
    def eval_bn():
        bn = nn.BatchNorm2d(3)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        return bn.eval()

    assert_matches(seeded(eval_bn), _x(4, 3, 5, 5))
    assert_matches(seeded(lambda: nn.BatchNorm2d(3, track_running_stats=False)), _x(4, 3, 5, 5))
    assert_matches(seeded(lambda: nn.BatchNorm1d(3)), _x(6, 3))
    assert_matches(seeded(lambda: nn.BatchNorm1d(3)), _x(4, 3, 5))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm3d_training_and_eval(momentum):
    make = seeded(lambda: nn.BatchNorm3d(3, momentum=momentum))
    store = assert_matches(make, _x(2, 3, 4, 3, 5), steps=2)
    assert [n for n, _ in store.deferred_parameters()] == ["weight", "bias"]

    def eval_bn():
        bn = nn.BatchNorm3d(3)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        return bn.eval()

    assert_matches(seeded(eval_bn), _x(2, 3, 4, 3, 5))


def test_partly_frozen_layer_defers_only_what_requires_grad():
    def make():
        lin = nn.Linear(5, 4)
        lin.weight.requires_grad_(False)
        return lin

    store = assert_matches(seeded(make), _x(3, 5))
    assert [n for n, _ in store.deferred_parameters()] == ["bias"]
    assert "frozen" in store.report()


def test_fully_frozen_layer_is_left_alone():
    lin = nn.Linear(5, 4).double().requires_grad_(False)
    store = defer_weight_grads(lin)
    assert "forward" not in lin.__dict__
    assert store.deferred_parameters() == store.immediate_parameters() == []
    assert "2 frozen" in store.report()
