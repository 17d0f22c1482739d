"""A BERT-like encoder with a masked-LM head, cut into pipeline blocks.

Blocks, in order::

    Embeddings                ids (B, L), or (ids, token_types) -> hidden (B, L, dim)
    EncoderBlock x n_layers   hidden (B, L, dim)                -> hidden (B, L, dim)
    MLMHead                   hidden (B, L, dim)                -> logits (B, L, vocab)

The pipeline input is a single tensor of token ids (token types are then all
zeros); the first block also accepts an ``(ids, token_types)`` tuple. Every
sequence is full length, so there is no padding mask. An encoder block is
post-norm as in the original BERT: ``LN(h + attn(h))`` then ``LN(h + mlp(h))``
with a GELU MLP. There is no dropout (runs stay deterministic) and no pooler or
next-sentence head: the model is trained on masked-LM alone.

Masking masks the same number of positions in every sequence (``n_masked``).
The loss ignores unmasked positions (``ignore_index=-100``) and averages over
masked ones; with a fixed count per sequence, the mean of the per-micro-batch
losses of equal-sized micro-batches equals the whole-batch loss, which a
pipeline relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twobp.models.common import Device, build_blocks, home_device, tie_head, upcast
from twobp.models.spec import ModelSpec, stacked_kinds

IGNORE_INDEX = -100
"""Target of an unmasked position; the loss skips it."""


@dataclass(frozen=True)
class BertConfig:
    """Size of a BERT-like model."""

    vocab_size: int
    """Number of token ids; the last id is the ``[MASK]`` token of the example data."""
    dim: int
    """Hidden width (1024 for BERT-Large)."""
    n_layers: int
    """Number of encoder blocks."""
    n_heads: int
    """Attention heads; ``dim`` must be a multiple of it."""
    ffn_dim: int
    """Hidden width of the MLP (4 * dim in BERT)."""
    seq_len: int
    """Tokens per sequence of the example data; at most ``max_positions``."""
    max_positions: int = 512
    """Number of learned position embeddings."""
    type_vocab_size: int = 2
    """Number of token types (segments)."""
    norm_eps: float = 1e-12
    """Epsilon of LayerNorm."""
    mask_fraction: float = 0.15
    """Share of the positions of each sequence that are masked, rounded to a fixed count."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"bert: dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.seq_len > self.max_positions:
            raise ValueError(
                f"bert: seq_len {self.seq_len} exceeds max_positions {self.max_positions}"
            )

    @property
    def n_masked(self) -> int:
        """Masked positions per sequence (at least one)."""
        return max(1, round(self.mask_fraction * self.seq_len))

    @property
    def mask_token_id(self) -> int:
        """The id that replaces masked tokens in the example data."""
        return self.vocab_size - 1


class Embeddings(nn.Module):
    """First block: word + position + token-type embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.dim)
        self.position = nn.Embedding(config.max_positions, config.dim)
        self.token_type = nn.Embedding(config.type_vocab_size, config.dim)
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, types = inputs if isinstance(inputs, tuple) else (inputs, torch.zeros_like(inputs))
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.word(ids) + self.position(positions) + self.token_type(types)
        return self.norm(h)  # type: ignore[no-any-return]


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention (no mask: sequences are full length)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.query = nn.Linear(config.dim, config.dim)
        self.key = nn.Linear(config.dim, config.dim)
        self.value = nn.Linear(config.dim, config.dim)
        self.output = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.n_heads, dim // self.n_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        )
        return self.output(out.transpose(1, 2).reshape(batch, seq, dim))  # type: ignore[no-any-return]


class EncoderBlock(nn.Module):
    """Post-norm encoder block: ``LN(h + attn(h))``, then ``LN(h + mlp(h))``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.attn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.up = nn.Linear(config.dim, config.ffn_dim)
        self.down = nn.Linear(config.ffn_dim, config.dim)
        self.mlp_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(h + self.attn(h))
        return self.mlp_norm(h + self.down(F.gelu(self.up(h))))  # type: ignore[no-any-return]


class MLMHead(nn.Module):
    """Last block: dense + GELU + LayerNorm transform, then the vocabulary projection.

    BERT ties the projection's weight to the word embedding, and so does
    :func:`bert_blocks`: a pipeline keeps the two uses in step across ranks.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = nn.Linear(config.dim, config.dim)
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.decoder = nn.Linear(config.dim, config.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.transform(h))))  # type: ignore[no-any-return]


def mlm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over masked positions (targets ``-100`` elsewhere)."""
    return F.cross_entropy(
        upcast(logits.flatten(0, 1)), target.flatten(), ignore_index=IGNORE_INDEX
    )


def mask_tokens(
    ids: torch.Tensor, n_masked: int, mask_token_id: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask exactly ``n_masked`` distinct random positions of every sequence.

    Masked positions become ``mask_token_id`` (always; no 80/10/10 split).

    Args:
        ids: token ids ``(B, L)``, on the generator's device.
        n_masked: positions to mask per sequence, ``1 <= n_masked <= L``.
        mask_token_id: the ``[MASK]`` id.
        generator: source of randomness for the positions.

    Returns:
        ``(masked_ids, target)``: the target holds the original id at masked
        positions and ``-100`` elsewhere.

    Raises:
        ValueError: if ``n_masked`` is out of range.
    """
    if not 1 <= n_masked <= ids.shape[1]:
        raise ValueError(f"n_masked must be in [1, {ids.shape[1]}], got {n_masked}")
    scores = torch.rand(ids.shape, generator=generator, device=ids.device)
    positions = scores.argsort(dim=1)[:, :n_masked]
    masked = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, positions, True)
    target = torch.where(masked, ids, torch.full_like(ids, IGNORE_INDEX))
    return torch.where(masked, torch.full_like(ids, mask_token_id), ids), target


def bert_blocks(
    config: BertConfig,
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """The blocks of a BERT-like model.

    Args:
        config: the model's size.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        ``[Embeddings, EncoderBlock * n_layers, MLMHead]``; the head's
        decoder weight is the word embedding's (tied, as in the published model).
    """
    factories = [
        lambda: Embeddings(config),
        *([lambda: EncoderBlock(config)] * config.n_layers),
        lambda: MLMHead(config),
    ]
    blocks = build_blocks(factories, device=device, dtype=dtype, seed=seed)
    embeddings, head = blocks[0], blocks[-1]
    assert isinstance(embeddings, Embeddings) and isinstance(head, MLMHead)
    tie_head(embeddings.word, head.decoder)  # as published
    return blocks


def build_bert(
    config: BertConfig,
    size: str = "custom",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> ModelSpec:
    """A BERT-like model as pipeline blocks, with masked-LM data and loss.

    Args:
        config: the model's size.
        size: the preset name, for reports.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        The model spec; ``example_input`` gives masked ids ``(B, seq_len)``,
        ``example_target`` the original ids at masked positions and -100 elsewhere.
    """
    blocks = bert_blocks(config, device=device, dtype=dtype, seed=seed)
    place = home_device(device)

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        # Ids below the [MASK] id, so the model never sees [MASK] as a real token.
        ids = torch.randint(0, config.mask_token_id, (batch_size, config.seq_len), generator=gen)
        masked, target = mask_tokens(ids, config.n_masked, config.mask_token_id, gen)
        return masked.to(place), target.to(place)

    head = blocks[-1]
    assert isinstance(head, MLMHead)
    return ModelSpec(
        family="bert",
        size=size,
        config=config,
        blocks=blocks,
        block_kinds=stacked_kinds(config.n_layers),
        loss_fn=mlm_loss,
        make_batch=make_batch,
        head_tied_in_reference=True,
        meta={
            "vocab_size": config.vocab_size,
            "seq_len": config.seq_len,
            "n_masked": config.n_masked,
            "tied_head_numel": head.decoder.weight.numel(),
        },
    )
