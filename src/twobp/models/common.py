"""Pieces shared by the model families: building blocks on a device, LM data and loss."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

Device = torch.device | str | None


def home_device(device: Device) -> torch.device:
    """Where a model built with ``device`` lives: that device, else PyTorch's default."""
    return torch.device(device) if device is not None else torch.get_default_device()


def build_blocks(
    factories: Iterable[Callable[[], nn.Module]],
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """Build blocks one by one directly on ``device``, then cast each to ``dtype``.

    Building under ``torch.device(device)`` allocates parameters where they will
    live (``"meta"`` allocates nothing, so a 7B model builds in seconds), and
    casting block by block keeps the extra float32 copy to one block at a time.

    Args:
        factories: callables that each build one block.
        device: where to build (default: PyTorch's default device).
        dtype: floating dtype of parameters and buffers (default: float32).
        seed: seed of the initialisation, so two builds give equal weights;
            ``None`` uses the global random state.

    Returns:
        The blocks, in order.
    """
    target = home_device(device)
    cuda = [target.index or 0] if target.type == "cuda" else []
    blocks: list[nn.Module] = []
    with torch.random.fork_rng(devices=cuda), target:
        if seed is not None:
            torch.manual_seed(seed)
        for make in factories:
            block = make()
            if dtype is not None:
                block.to(dtype=dtype)
            blocks.append(block)
    return blocks


class TokenEmbedding(nn.Module):
    """First block of a language model: token ids ``(B, L)`` to hidden states ``(B, L, dim)``."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)  # type: ignore[no-any-return]


class LMHead(nn.Module):
    """Last block of a language model: final RMSNorm, then the projection to logits.

    LLaMA has its own output weight; Mamba ties it to the embedding (see
    :func:`tie_head`): the first and the last block then share one parameter,
    which a pipeline keeps in step across the ranks that hold them.
    """

    def __init__(self, dim: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))  # type: ignore[no-any-return]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token logits ``(B, L, V)`` against ids ``(B, L)``."""
    return F.cross_entropy(upcast(logits.flatten(0, 1)), target.flatten())


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is in a 16-bit float type (a softmax over a large
    vocabulary loses too much in bf16), else unchanged (float64 stays float64)."""
    return x.float() if x.element_size() < 4 else x


def token_batches(
    vocab_size: int, seq_len: int, device: Device
) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """``make_batch(batch_size, seed)`` of :func:`random_token_batch` on ``device``."""

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return random_token_batch(vocab_size, seq_len, batch_size, seed, device)

    return make_batch


def random_token_batch(
    vocab_size: int, seq_len: int, batch_size: int, seed: int, device: Device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next tokens, each ``(batch_size, seq_len)`` int64."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tie_head(embedding: nn.Embedding, projection: nn.Linear) -> None:
    """Make ``projection`` read the embedding's weight, as models with tied embeddings do.

    The embedding's N(0, 1) initialisation is scaled to the N(0, 0.02) of
    the published models: it now also makes the logits.
    """
    with torch.no_grad():
        embedding.weight.mul_(0.02)
    projection.weight = embedding.weight
