"""A LLaMA-like decoder whose MLPs are top-k routed SwiGLU experts, cut into pipeline blocks.

Blocks, in order::

    MoeEmbedding           ids (B, L) int64          -> (hidden (B, L, dim), aux (1,))
    MoeBlock x n_layers    (hidden, aux)             -> (hidden, aux + this layer's aux)
    MoeHead                (hidden, aux)             -> (logits (B, L, vocab), aux)

A block is pre-norm attention (as :mod:`twobp.models.llama`) then a mixture of
experts: a router (``nn.Linear``) picks ``top_k`` of ``n_experts`` SwiGLU
experts per token, their outputs weighted by the renormalised router
probabilities, plus a shared SwiGLU expert when ``shared_ffn_dim > 0``. The
experts' weights are stacked ``[experts, out, in]`` and each expert multiplies
its tokens with ``F.linear(x, w[e])``: the 2BP engine defers each expert's
weight gradient and concatenates its tokens over every micro-batch.

The load-balancing loss (Switch Transformer's ``n_experts * sum_e f_e P_e``:
``f_e`` the share of token slots routed to expert ``e``, ``P_e`` its mean router
probability) travels beside the hidden states, summed over the layers, and
:class:`MoeLoss` adds it to the cross-entropy with weight ``aux_weight``. It is
thus part of each micro-batch's loss: exact over micro-batches, data-parallel
replicas and accumulation, like the loss itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.models.common import (
    Device,
    LMHead,
    build_blocks,
    home_device,
    lm_loss,
    token_batches,
)
from twobp.models.llama import CausalSelfAttention, LlamaConfig, SwiGLU
from twobp.models.spec import ModelSpec, stacked_kinds


@dataclass(frozen=True)
class MoeConfig:
    """Size of a mixture-of-experts decoder."""

    vocab_size: int
    """Number of token ids."""
    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Attention heads; ``dim`` must split into heads of even width."""
    ffn_dim: int
    """Hidden width of each routed SwiGLU expert."""
    n_experts: int
    """Routed experts per block."""
    top_k: int
    """Experts each token is routed to."""
    seq_len: int
    """Tokens per sequence of the example data."""
    shared_ffn_dim: int = 0
    """Hidden width of a shared SwiGLU expert every token goes through (0: none)."""
    aux_weight: float = 0.01
    """Weight of the load-balancing loss in the training loss."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(
                f"moe: top_k {self.top_k} must be between 1 and n_experts {self.n_experts}"
            )
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"moe: dim {self.dim} must split into {self.n_heads} heads of even width"
            )

    def attention(self) -> LlamaConfig:
        """The attention's size, as a LLaMA config."""
        return LlamaConfig(
            self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            ffn_dim=self.ffn_dim,
            seq_len=self.seq_len,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
        )


class Experts(nn.Module):
    """Routed SwiGLU experts stacked ``[E, out, in]``: ``w1``, ``w3``, ``w2``."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        e, d, f = config.n_experts, config.dim, config.ffn_dim
        self.w1 = nn.Parameter(torch.randn(e, f, d) * d**-0.5)
        self.w3 = nn.Parameter(torch.randn(e, f, d) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, f) * f**-0.5)

    def forward(self, tokens: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """Each token through its chosen experts, weighted.

        Args:
            tokens: ``(N, dim)``.
            chosen: ``(N, top_k)`` expert indices.
            weights: ``(N, top_k)`` their weights.
        """
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // top_k
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()
        x = tokens[rows]
        parts, start = [], 0
        for e, n in enumerate(counts):
            xe = x[start : start + n]
            h = F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e])
            parts.append(F.linear(h, self.w2[e]))
            start += n
        y = torch.cat(parts) * weights.reshape(-1)[order, None].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, rows, y)


class MixtureOfExperts(nn.Module):
    """Router, routed experts and an optional shared expert; returns the output and the aux loss."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config)
        self.shared = SwiGLU(config.dim, config.shared_ffn_dim) if config.shared_ffn_dim else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(-1)
        weights, chosen = torch.topk(probs, self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(tokens, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(x.shape), load_balancing_loss(probs, chosen)


def load_balancing_loss(probs: Tensor, chosen: Tensor) -> Tensor:
    """``n_experts * sum_e f_e * P_e`` (Switch Transformer), shape ``(1,)``.

    Args:
        probs: ``(N, n_experts)`` router probabilities.
        chosen: ``(N, top_k)`` the experts each token went to.
    """
    n_experts = probs.shape[-1]
    counts = torch.bincount(chosen.reshape(-1), minlength=n_experts).to(probs.dtype)
    share = counts / chosen.numel()
    return (n_experts * (share * probs.mean(0)).sum()).reshape(1)


class MoeEmbedding(nn.Module):
    """Token embedding; starts the auxiliary loss at zero."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h = self.embed(ids)
        return h, h.new_zeros(1)


class MoeBlock(nn.Module):
    """Pre-norm attention then mixture of experts, each with a residual; adds its aux loss."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config.attention())
        self.moe_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.moe = MixtureOfExperts(config)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, aux = inputs
        h = h + self.attn(self.attn_norm(h))
        out, layer_aux = self.moe(self.moe_norm(h))
        return h + out, aux + layer_aux.to(aux.dtype)


class MoeHead(LMHead):
    """Final norm and output projection; passes the aux loss on to the loss."""

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        h, aux = inputs
        return super().forward(h), aux


@dataclass(frozen=True)
class MoeLoss:
    """Next-token cross-entropy plus ``aux_weight`` times the load-balancing loss."""

    aux_weight: float

    def __call__(self, output: Any, target: Tensor) -> Tensor:
        """The loss of ``output``, the head's ``(logits, aux)``, against next ids ``target``."""
        logits, aux = output
        aux_loss: Tensor = aux.sum()
        return lm_loss(logits, target) + self.aux_weight * aux_loss


def moe_blocks(
    config: MoeConfig,
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """The blocks of the mixture-of-experts decoder.

    Args:
        config: the model's size.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        ``[MoeEmbedding, MoeBlock * n_layers, MoeHead]``.
    """
    factories = [
        lambda: MoeEmbedding(config.vocab_size, config.dim),
        *([lambda: MoeBlock(config)] * config.n_layers),
        lambda: MoeHead(config.dim, config.vocab_size, config.norm_eps),
    ]
    return build_blocks(factories, device=device, dtype=dtype, seed=seed)


def build_moe(
    config: MoeConfig,
    size: str = "custom",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> ModelSpec:
    """The mixture-of-experts decoder as pipeline blocks, with next-token data and loss.

    Args:
        config: the model's size.
        size: the preset name, for reports.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        The model spec; ``loss_fn`` is :class:`MoeLoss` (cross-entropy plus the
        weighted load-balancing loss).
    """
    blocks = moe_blocks(config, device=device, dtype=dtype, seed=seed)
    return ModelSpec(
        family="moe",
        size=size,
        config=config,
        blocks=blocks,
        block_kinds=stacked_kinds(config.n_layers),
        loss_fn=MoeLoss(config.aux_weight),
        make_batch=token_batches(config.vocab_size, config.seq_len, home_device(device)),
        meta={"vocab_size": config.vocab_size, "seq_len": config.seq_len},
    )
