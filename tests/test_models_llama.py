"""LLaMA-like decoder: rotary embeddings, causality, block structure."""

import pytest
import torch
from torch import nn

from twobp.models import build_model
from twobp.models.llama import DecoderBlock, apply_rotary, rotary_cos_sin


def test_rotary_preserves_norm_and_depends_on_relative_position_only():
    torch.manual_seed(0)
    head_dim, seq = 8, 12
    cos, sin = rotary_cos_sin(seq, head_dim, 10000.0, torch.device("cpu"), torch.float64)
    q = torch.randn(head_dim, dtype=torch.float64).expand(1, 1, seq, head_dim)
    k = torch.randn(head_dim, dtype=torch.float64).expand(1, 1, seq, head_dim)
    rq, rk = apply_rotary(q, cos, sin)[0, 0], apply_rotary(k, cos, sin)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q[0, 0].norm(dim=-1))
    # <R(m) q, R(n) k> is a function of m - n.
    torch.testing.assert_close(rq[5] @ rk[2], rq[9] @ rk[6])
    torch.testing.assert_close(rq[3] @ rk[3], q[0, 0, 0] @ k[0, 0, 0])


def test_logits_at_a_position_ignore_later_tokens():
    spec = build_model("llama", "tiny", dtype=torch.float64, n_layers=2)
    model = spec.sequential()
    ids = spec.example_input(2)
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % spec.meta["vocab_size"]
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_decoder_block_holds_parameters_only_in_deferrable_layers():
    spec = build_model("llama", "tiny", device="meta")
    deferrable = (nn.Linear, nn.Embedding, nn.RMSNorm)
    for block in spec.blocks:
        for module in block.modules():
            own = list(module.parameters(recurse=False))
            assert not own or isinstance(module, deferrable), type(module).__name__


def test_decoder_block_is_pre_norm_residual():
    # With zero output projections a pre-norm block is the identity.
    spec = build_model("llama", "tiny", dtype=torch.float64, n_layers=1)
    block = spec.blocks[1]
    assert isinstance(block, DecoderBlock)
    with torch.no_grad():
        block.attn.wo.weight.zero_()
        block.mlp.w2.weight.zero_()
    h = torch.randn(2, 5, 64, dtype=torch.float64)
    torch.testing.assert_close(block(h), h)


def test_dim_must_split_into_even_heads():
    with pytest.raises(ValueError, match="heads of even width"):
        build_model("llama", "tiny", device="meta", n_heads=5)
