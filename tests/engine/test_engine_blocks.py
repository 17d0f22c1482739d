"""Composite blocks: covered and immediate parameters mixed, exact gradients (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_harness import assert_matches, compare_with_autograd, randn, seeded
from torch import Tensor, nn


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block with residuals."""

    def __init__(self, width: int = 8, heads: int = 2, norm: type[nn.Module] = nn.LayerNorm):
        super().__init__()
        self.heads = heads
        self.norm1 = norm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = norm(width)
        self.mlp = MLP(width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class ConvBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn plus the input."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class TiedLanguageModel(nn.Module):
    """Embedding, a block, and an output layer tied to the embedding through F.linear."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(6, width))  # raw parameter: immediate
        self.block = TransformerBlock(width, norm=nn.RMSNorm)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return F.linear(self.norm(self.block(h)), self.embed.weight)


class SharedLinear(nn.Module):
    """The same Linear called twice, and a second Linear sharing its weight."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.twin = nn.Linear(width, width, bias=False)
        self.twin.weight = self.lin.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.twin(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class ScaledResidual(nn.Module):
    """A raw nn.Parameter and a custom autograd-free op around a covered layer."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.shift = nn.Parameter(torch.tensor(0.25))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.gain * torch.sin(self.lin(x)) + self.shift


class TwoInputsTwoOutputs(nn.Module):
    """A stage with two inputs (one unused by an output) and two outputs."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, 3)

    def forward(self, x: Tensor, skip: Tensor) -> tuple[Tensor, Tensor]:
        h = self.a(x)
        return h + skip, self.b(h)


def _activations(*shape: int):
    return lambda mb: [(randn(*shape, seed=mb), True)]


def test_mlp():
    assert_matches(seeded(MLP), _activations(3, 5, 8))


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_transformer_block(norm):
    store = assert_matches(seeded(lambda: TransformerBlock(norm=norm)), _activations(2, 5, 8))
    assert store.immediate_parameters() == []


def test_conv_block_with_batch_norm_and_residual():
    assert_matches(seeded(ConvBlock), _activations(3, 4, 6, 6), steps=2)


def test_embedding_block_with_tied_output_and_raw_parameter():
    def tokens(mb):
        g = torch.Generator().manual_seed(mb)
        return [(torch.randint(0, 11, (2, 6), generator=g), False)]

    store = assert_matches(seeded(TiedLanguageModel), tokens)
    assert [n for n, _ in store.immediate_parameters()] == ["pos"]
    assert ("embed.weight", store.deferred_parameters()[0][1]) == store.deferred_parameters()[0]


def test_same_linear_twice_and_shared_weight():
    store = assert_matches(seeded(SharedLinear), _activations(3, 6))
    assert [n for n, _ in store.deferred_parameters()] == ["lin.weight", "lin.bias"]


def test_raw_parameters_are_immediate():
    store = assert_matches(seeded(ScaledResidual), _activations(4, 6))
    assert [n for n, _ in store.immediate_parameters()] == ["gain", "shift"]
    assert "ScaledResidual (root)" in store.report()


def test_several_inputs_and_outputs():
    def inputs(mb):
        return [(randn(2, 6, seed=mb), True), (randn(2, 6, seed=100 + mb), True)]

    assert_matches(seeded(TwoInputsTwoOutputs), inputs)


def test_stage_of_whole_model_with_b_and_plain_forward_mixed():
    """B for some micro-batches (one with a plain forward) next to I/W for others."""
    schedule = [("F", 0), ("B", 0), ("F", 1), ("F", 2), ("I", 2), ("B", 3), ("I", 1)]
    schedule.append(("W", (1, 2)))
    comparison, _ = compare_with_autograd(
        seeded(lambda: nn.Sequential(ConvBlock(), nn.Flatten(), nn.Linear(64, 5)))(),
        _activations(2, 4, 4, 4),
        schedule,
        steps=2,
    )
    assert comparison.worst() <= 1e-10, comparison
