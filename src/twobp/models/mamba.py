"""A Mamba-like selective state-space language model in plain PyTorch.

Blocks, in order::

    TokenEmbedding          ids (B, L) int64     -> hidden (B, L, d_model)
    MambaBlock x n_layers   hidden (B, L, d)     -> hidden (B, L, d)
    LMHead                  hidden (B, L, d)     -> logits (B, L, vocab)

A Mamba block is ``h + mixer(rmsnorm(h))``; the mixer projects up to two
branches of width ``d_inner``, runs one through a causal depthwise convolution,
SiLU and the selective scan, gates it with SiLU of the other, and projects back
down. The scan is a sequential loop over time in plain PyTorch (no fused CUDA
kernel): exact, and fast enough for sequences of a few hundred tokens.
"""

from __future__ import annotations

import math
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
    tie_head,
    token_batches,
)
from twobp.models.spec import ModelSpec, stacked_kinds


@dataclass(frozen=True)
class MambaConfig:
    """Size of a Mamba-like model (defaults follow Mamba-1)."""

    vocab_size: int
    """Number of token ids."""
    d_model: int
    """Width of the residual stream (2048 for Mamba-1.4B)."""
    n_layers: int
    """Number of Mamba blocks."""
    seq_len: int
    """Tokens per sequence of the example data."""
    d_state: int = 16
    """State size N of the selective scan, per channel."""
    d_conv: int = 4
    """Kernel width of the causal depthwise convolution."""
    expand: int = 2
    """``d_inner = expand * d_model``."""
    dt_rank: int = 0
    """Rank of the step-size projection; 0 means ``ceil(d_model / 16)``."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""

    @property
    def d_inner(self) -> int:
        """Width of the inner (scanned) branch."""
        return self.expand * self.d_model

    @property
    def rank(self) -> int:
        """The step-size projection rank actually used."""
        return self.dt_rank or math.ceil(self.d_model / 16)


def selective_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
) -> torch.Tensor:
    """The selective scan of Mamba, sequential over time.

    With ``dA_t = exp(delta_t * A)`` and ``dBx_t = delta_t * B_t * x_t``::

        h_t = dA_t * h_{t-1} + dBx_t        (state per channel, size N)
        y_t = <C_t, h_t> + D * x_t

    Args:
        x: inputs ``(batch, L, D_in)``.
        delta: positive step sizes ``(batch, L, D_in)``.
        a: state matrix (negative) ``(D_in, N)``.
        b: input matrices ``(batch, L, N)``.
        c: output matrices ``(batch, L, N)``.
        d: skip weights ``(D_in,)``.

    Returns:
        ``y`` of shape ``(batch, L, D_in)``.
    """
    # Time-major (L, batch, D_in, N) so that each step reads contiguous memory.
    delta_t, x_t = delta.transpose(0, 1), x.transpose(0, 1)
    decay = torch.exp(delta_t.unsqueeze(-1) * a)
    drive = (delta_t * x_t).unsqueeze(-1) * b.transpose(0, 1).unsqueeze(2)
    readout = c.transpose(0, 1).unsqueeze(-1)  # (L, batch, N, 1)
    # unbind, not decay[t]: the backward of unbind is one stack, while each
    # indexing backward would write a zero tensor the size of the whole sequence.
    # Reading y_t out at each step avoids stacking all L states into one tensor.
    state = torch.zeros_like(drive[0])
    outputs = []
    steps = zip(decay.unbind(0), drive.unbind(0), readout.unbind(0), strict=True)
    for decay_step, drive_step, readout_step in steps:
        state = decay_step * state + drive_step
        outputs.append(torch.bmm(state, readout_step))
    y = torch.stack(outputs, dim=1).squeeze(-1)
    return y + x * d


class MambaMixer(nn.Module):
    """In-projection, causal depthwise conv, selective scan, gate and out-projection."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        inner, state, rank = config.d_inner, config.d_state, config.rank
        self.d_state, self.rank = state, rank
        self.in_proj = nn.Linear(config.d_model, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, config.d_conv, groups=inner, padding=config.d_conv - 1)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.out_proj = nn.Linear(inner, config.d_model, bias=False)
        # A = -exp(A_log) is the (negative, real) diagonal state matrix: S4D-real init.
        a_init = torch.arange(1, state + 1, dtype=torch.float32).repeat(inner, 1)
        self.A_log = nn.Parameter(torch.log(a_init))
        self.D = nn.Parameter(torch.ones(inner))
        with torch.no_grad():
            # Step sizes start log-uniform in [1e-3, 1e-1]: bias = softplus^-1(dt).
            dt = torch.exp(torch.rand(inner) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp(min=1e-4)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            nn.init.uniform_(self.dt_proj.weight, -(rank**-0.5), rank**-0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        seq = h.shape[1]
        x, gate = self.in_proj(h).chunk(2, dim=-1)
        # Padding both sides then keeping the first L outputs makes the conv causal.
        x = F.silu(self.conv(x.transpose(1, 2))[..., :seq].transpose(1, 2))
        dt, b, c = self.x_proj(x).split([self.rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt))
        y = selective_scan(x, delta, -torch.exp(self.A_log), b, c, self.D)
        return self.out_proj(y * F.silu(gate))  # type: ignore[no-any-return]


class MambaBlock(nn.Module):
    """``h + mixer(rmsnorm(h))``."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mixer = MambaMixer(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.norm(h))  # type: ignore[no-any-return]


def mamba_blocks(
    config: MambaConfig,
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """The blocks of a Mamba-like model.

    Args:
        config: the model's size.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        ``[TokenEmbedding, MambaBlock * n_layers, LMHead]``; the head's
        projection is the embedding's weight (tied, as in the published model).
    """
    factories = [
        lambda: TokenEmbedding(config.vocab_size, config.d_model),
        *([lambda: MambaBlock(config)] * config.n_layers),
        lambda: LMHead(config.d_model, config.vocab_size, config.norm_eps),
    ]
    blocks = build_blocks(factories, device=device, dtype=dtype, seed=seed)
    embedding, head = blocks[0], blocks[-1]
    assert isinstance(embedding, TokenEmbedding) and isinstance(head, LMHead)
    tie_head(embedding.embed, head.output)  # as published
    return blocks


def build_mamba(
    config: MambaConfig,
    size: str = "custom",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> ModelSpec:
    """A Mamba-like model as pipeline blocks, with next-token data and loss.

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
    blocks = mamba_blocks(config, device=device, dtype=dtype, seed=seed)
    make_batch = token_batches(config.vocab_size, config.seq_len, home_device(device))
    head = blocks[-1]
    assert isinstance(head, LMHead)
    return ModelSpec(
        family="mamba",
        size=size,
        config=config,
        blocks=blocks,
        block_kinds=stacked_kinds(config.n_layers),
        loss_fn=lm_loss,
        make_batch=make_batch,
        head_tied_in_reference=True,
        meta={
            "vocab_size": config.vocab_size,
            "seq_len": config.seq_len,
            "tied_head_numel": head.output.weight.numel(),
        },
    )
