"""A LLaMA-like decoder-only Transformer cut into pipeline blocks.

Blocks, in order::

    TokenEmbedding            ids (B, L) int64      -> hidden (B, L, dim)
    DecoderBlock x n_layers   hidden (B, L, dim)    -> hidden (B, L, dim)
    LMHead                    hidden (B, L, dim)    -> logits (B, L, vocab)

A decoder block is pre-norm: ``h + attn(rmsnorm(h))`` then ``h + mlp(rmsnorm(h))``,
with rotary position embeddings on queries and keys, causal attention through
``F.scaled_dot_product_attention`` and a SwiGLU MLP. Every parameter lives in an
``nn.Linear``, ``nn.Embedding`` or ``nn.RMSNorm``, the layer types whose weight
gradients the 2BP engine defers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twobp.models.common import (
    Device,
    LMHead,
    TokenEmbedding,
    build_blocks,
    home_device,
    lm_loss,
    token_batches,
)
from twobp.models.spec import ModelSpec, stacked_kinds


@dataclass(frozen=True)
class LlamaConfig:
    """Size of a LLaMA-like model."""

    vocab_size: int
    """Number of token ids."""
    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Attention heads; ``dim`` must be a multiple of it."""
    ffn_dim: int
    """Hidden width of the SwiGLU MLP (11008 for LLaMA-7B)."""
    seq_len: int
    """Tokens per sequence of the example data."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"llama: dim {self.dim} must split into {self.n_heads} heads of even width"
            )


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles, each ``(seq_len, head_dim // 2)``."""
    # Computed in float32 on every call: cheap next to attention, and it keeps the
    # block free of buffers that a build on the meta device would leave empty.
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, theta**-exponents)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + d/2])`` of ``x`` ``(B, H, L, d)`` by the angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.rope_theta = config.rope_theta
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        cos, sin = rotary_cos_sin(seq, self.head_dim, self.rope_theta, x.device, x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))  # type: ignore[no-any-return]


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.ffn_dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))  # type: ignore[no-any-return]


def llama_blocks(
    config: LlamaConfig,
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """The blocks of a LLaMA-like model.

    Args:
        config: the model's size.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        ``[TokenEmbedding, DecoderBlock * n_layers, LMHead]``.
    """
    factories = [
        lambda: TokenEmbedding(config.vocab_size, config.dim),
        *([lambda: DecoderBlock(config)] * config.n_layers),
        lambda: LMHead(config.dim, config.vocab_size, config.norm_eps),
    ]
    return build_blocks(factories, device=device, dtype=dtype, seed=seed)


def build_llama(
    config: LlamaConfig,
    size: str = "custom",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> ModelSpec:
    """A LLaMA-like model as pipeline blocks, with next-token data and loss.

    Args:
        config: the model's size.
        size: the preset name, for reports.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        The model spec; ``example_input`` gives ids ``(B, seq_len)``,
        ``example_target`` the next ids, and ``loss_fn`` the mean cross-entropy.
    """
    blocks = llama_blocks(config, device=device, dtype=dtype, seed=seed)
    make_batch = token_batches(config.vocab_size, config.seq_len, home_device(device))
    return ModelSpec(
        family="llama",
        size=size,
        config=config,
        blocks=blocks,
        block_kinds=stacked_kinds(config.n_layers),
        loss_fn=lm_loss,
        make_batch=make_batch,
        meta={"vocab_size": config.vocab_size, "seq_len": config.seq_len},
    )
