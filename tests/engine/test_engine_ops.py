"""Capture at the operation: whoever calls a covered op on a stage parameter, its W is deferred.

Every module here calls the operations itself (functional calls, keyword
arguments, custom modules, views of weights); gradients equal plain
autograd's (float64, 1e-10) over every W plan, and the report says how each
parameter was read.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_harness import assert_matches, compare_with_autograd, plan_f_i_w, randn, seeded
from torch import Tensor, nn

from twobp.engine import TwoStageBackwardError, defer_weight_grads


def _x(*shape: int, grad: bool = True):
    return lambda mb: [(randn(*shape, seed=mb), grad)]


def _tokens(vocab: int, *shape: int):
    def make(mb):
        return [
            (torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(mb)), False)
        ]

    return make


class KeywordLinear(nn.Linear):
    """A Linear called with keyword arguments, as modules often are."""

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input=input, weight=self.weight, bias=self.bias)


class GPT2Conv1D(nn.Module):
    """GPT-2's Conv1D: a transposed weight read by ``torch.addmm``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class Matmuls(nn.Module):
    """A parameter on either side of ``@``, ``torch.mm``, ``bmm`` and ``Tensor.matmul``."""

    def __init__(self) -> None:
        super().__init__()
        self.right = nn.Parameter(torch.randn(6, 5) * 0.3)
        self.left = nn.Parameter(torch.randn(4, 3) * 0.3)
        self.square = nn.Parameter(torch.randn(5, 5) * 0.3)
        self.batched = nn.Parameter(torch.randn(2, 5, 5) * 0.3)

    def forward(self, x: Tensor) -> Tensor:  # x: (2, 3, 6)
        h = x @ self.right  # (2, 3, 5), right, batch dims flattened
        h = torch.tanh(self.left @ h)  # (2, 4, 5), left
        h = torch.bmm(h, self.batched)  # (2, 4, 5), batched right
        h = torch.mm(h.reshape(-1, 5), self.square).view(2, 4, 5)
        return h.matmul(self.square) + torch.matmul(h[0, 0], self.square)  # a 1-D operand


class Views(nn.Module):
    """Weights read through views: transposed, squeezed and unsqueezed (casts: see autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4, bias=False)
        self.conv = nn.Conv1d(4, 4, 3, groups=4, padding=2)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (2, 5, 6)
        h = x @ self.proj.weight.t()  # the transposed weight of a Linear
        weight = self.conv.weight.squeeze(1)  # Mamba's causal convolution: (4, 3) ...
        h = F.conv1d(h.transpose(1, 2), weight.unsqueeze(1), self.conv.bias, padding=2, groups=4)
        w = self.out.weight.to(x.dtype).T.mT  # a cast to its own dtype, two transposes
        return F.linear(h.transpose(1, 2), w, self.out.bias)


class Norms(nn.Module):
    """Every covered norm, called functionally with keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.rms = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.gn = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:  # x: (3, 4, 8)
        h = F.layer_norm(x, normalized_shape=(8,), weight=self.ln.weight, bias=self.ln.bias)
        h = F.rms_norm(h, [8], weight=self.rms, eps=1e-4)
        h = F.group_norm(h, num_groups=2, weight=self.gn.weight, bias=self.gn.bias)
        return self.bn(h)


class Shared(nn.Module):
    """One parameter read by several operations (its W comes from every use)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.lin = nn.Linear(6, 6)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        h = self.lin(torch.tanh(self.lin(h)))  # the same Linear twice: one op, two stashes
        h = F.linear(h, self.lin.weight)  # the same weight without bias: a second op
        return F.linear(h, self.embed.weight) + F.embedding(tokens, self.embed.weight)[..., :1]


class Gated(nn.Module):
    """Parameters read elementwise only stay immediate; the weights beside them are deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.A_log = nn.Parameter(torch.linspace(-1, 1, 5))
        self.D = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * -torch.exp(self.A_log.float()) + x * self.D[None, :]


class ScaleFunction(torch.autograd.Function):
    """A custom autograd Function holding a weight: the engine cannot split it."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight.t(), x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])


class WithCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.weight = nn.Parameter(torch.randn(5, 5) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return ScaleFunction.apply(self.lin(x), self.weight)


def test_keyword_arguments():
    store = assert_matches(seeded(lambda: KeywordLinear(5, 4)), _x(3, 5))
    assert [n for n, _ in store.deferred_parameters()] == ["weight", "bias"]


def test_gpt2_conv1d_through_addmm():
    store = assert_matches(seeded(lambda: GPT2Conv1D(4, 6)), _x(2, 3, 6))
    assert [n for n, _ in store.deferred_parameters()] == ["weight", "bias"]
    assert "torch.addmm in GPT2Conv1D (root)" in store.report()


def test_parameter_on_either_side_of_a_matrix_product():
    store = assert_matches(seeded(Matmuls), _x(2, 3, 6))
    assert store.immediate_parameters() == []
    report = store.report()
    assert "torch.mm, torch.matmul in Matmuls (root)" in report


def test_weights_read_through_views_and_casts():
    store = assert_matches(seeded(Views), _x(2, 5, 6))
    assert store.immediate_parameters() == []


def test_functional_norms_with_keyword_arguments():
    store = assert_matches(seeded(Norms), _x(3, 4, 8), steps=2)
    assert store.immediate_parameters() == []


def test_a_parameter_read_in_several_places_gets_w_from_every_use():
    store = assert_matches(seeded(Shared), _tokens(9, 2, 5))
    assert store.immediate_parameters() == []
    report = store.report()
    assert "embed.weight  F.embedding, F.linear in Embedding 'embed'" in report
    assert "lin.weight    F.linear x2 in Linear 'lin'" in report  # with and without bias


def test_parameters_read_elementwise_stay_immediate_and_exact():
    store = assert_matches(seeded(Gated), _x(4, 5))
    assert [n for n, _ in store.deferred_parameters()] == ["lin.weight", "lin.bias"]
    assert [n for n, _ in store.immediate_parameters()] == ["A_log", "D"]
    report = store.report()
    assert "A_log       used by torch.exp, in Gated (root)" in report
    assert "D           used by Tensor.__getitem__, in Gated (root)" in report


def test_a_custom_autograd_function_holding_a_weight_is_immediate_and_exact():
    store = assert_matches(seeded(WithCustomFunction), _x(3, 5))
    assert [n for n, _ in store.immediate_parameters()] == ["weight"]
    assert "custom autograd Function" in store.report()


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_functional_convolutions_padding_same_and_unbatched():
    class Convs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w2 = nn.Parameter(torch.randn(4, 3, 2, 3) * 0.3)
            self.w1 = nn.Parameter(torch.randn(3, 4, 4) * 0.3)
            self.b1 = nn.Parameter(torch.randn(3) * 0.1)
            self.w3 = nn.Parameter(torch.randn(3, 3, 2) * 0.3)

        def forward(self, x: Tensor) -> Tensor:  # x: (3, 5, 6) unbatched image
            h = F.conv2d(x, self.w2, padding="same")  # even kernel: asymmetric padding
            h = F.conv1d(h.flatten(1), weight=self.w1, bias=self.b1, stride=2, padding="valid")
            return F.conv1d(h, self.w3, dilation=(2,), padding=[1])

    store = assert_matches(seeded(Convs), _x(3, 5, 6))
    assert store.immediate_parameters() == []


def test_embedding_called_functionally_with_a_negative_padding_idx():
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(7, 4))

        def forward(self, tokens: Tensor) -> Tensor:
            return F.embedding(tokens, self.table, padding_idx=-1)

    assert_matches(seeded(Lookup), _tokens(7, 3, 5))


def test_frozen_parameters_and_no_grad_regions_run_plain():
    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            with torch.no_grad():
                y = self.lin(x)
            return self.lin(self.frozen(x)) + y

    store = assert_matches(seeded(Partly), _x(3, 4))
    assert [n for n, _ in store.deferred_parameters()] == ["lin.weight", "lin.bias"]
    assert "frozen.weight" in store.report()


def test_report_says_how_each_parameter_was_read_after_a_forward():
    module = seeded(Gated)()
    store = defer_weight_grads(module, label="rank 0 stage 1")
    assert "predicted" in store.report()
    x = randn(3, 5, seed=0).requires_grad_()
    with store.forward(0):
        y = module(x)
    report = store.report()
    assert report.splitlines()[:2] == [
        "2BP weight gradients of rank 0 stage 1: 2 deferred, 2 immediate, 0 frozen",
        "(as the forwards seen so far read each parameter)",
    ]
    assert "lin.weight  F.linear in Linear 'lin'" in report
    store.backward_input(0, [y], [torch.ones_like(y)], [x])
    store.backward_weight([0])
    store.finish_step()


def test_partly_immediate_parameter_counts_as_deferred_and_says_why():
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) + self.lin.weight.sum()

    store = assert_matches(seeded(Both), _x(3, 4))
    assert [n for n, _ in store.deferred_parameters()] == ["lin.weight", "lin.bias"]
    assert "also used by Tensor.sum: autograd adds that part" in store.report()


def test_a_parameter_of_another_module_is_refused_by_name_of_the_operation():
    outside = nn.Linear(4, 4).double()
    module = seeded(lambda: nn.Linear(4, 4))()
    store = defer_weight_grads(module, label="rank 1 stage 0")
    x = randn(2, 4, seed=0)
    for reads in (lambda: outside(module(x)), lambda: x @ outside.weight):
        with (
            pytest.raises(
                TwoStageBackwardError, match=r"rank 1 stage 0: .* micro-batch 3 .*\[4, 4\]"
            ),
            store.forward(3),
        ):
            reads()
    # A parameter that needs no gradient is a constant.
    outside.requires_grad_(False)
    with store.forward(3):
        outside(module(x))


def test_forward_inside_another_store_forward_is_refused():
    a, b = seeded(lambda: nn.Linear(4, 4))(), seeded(lambda: nn.Linear(4, 4))()
    store_a, store_b = defer_weight_grads(a), defer_weight_grads(b)
    with store_a.forward(0), pytest.raises(TwoStageBackwardError, match="another stage"):  # noqa: SIM117
        with store_b.forward(0):
            pass


def test_only_what_requires_grad_in_the_schedule_b_and_plain_forward_mixed():
    schedule = [("F", 0), ("B", 0), ("F", 1), ("F", 2), ("I", 2), ("B", 3), ("I", 1)]
    schedule.append(("W", (1, 2)))
    comparison, _ = compare_with_autograd(seeded(Matmuls)(), _x(2, 3, 6), schedule, steps=2)
    assert comparison.worst() <= 1e-10, comparison
    comparison, _ = compare_with_autograd(
        seeded(Views)(), _x(2, 5, 6), plan_f_i_w(3, [("W", (2, 0, 1), 2)])
    )
    assert comparison.worst() <= 1e-10, comparison
