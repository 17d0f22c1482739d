"""An encoder-decoder as a 2-stage pipeline: the encoder on one rank, the decoder and head on
the other, one token embedding shared by the encoder, the decoder and the head.

Run it either way:

    torchrun --nproc-per-node 2 examples/encoder_decoder.py
    python examples/encoder_decoder.py                 # starts 2 local ranks itself

``twobp.split`` and ``integrations.transformers.blocks`` cut a model into one chain of
blocks; an encoder-decoder (T5, BART) is two chains that meet at the cross-attention, so
its blocks are written by hand, as here: each block takes what the one before returns
(a tensor or a tuple of tensors), so the encoder block hands on both the encoder's output
(the decoder's memory) and the decoder's input tokens. The embedding is one
``nn.Parameter`` used by blocks on both ranks: the pipeline finds it and adds its
gradients over the ranks that hold it, as plain PyTorch does within one process.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.runtime import Pipeline, launch

VOCAB, WIDTH, HEADS = 32, 32, 4


class Encoder(nn.Module):
    """Embed the source, encode it; hand on (memory, decoder input tokens)."""

    def __init__(self, embedding: nn.Embedding, layers: int) -> None:
        super().__init__()
        self.embedding = embedding
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        source, target_in = batch
        return self.layers(self.embedding(source)), target_in


class Decoder(nn.Module):
    """Embed the decoder input with the same embedding, attend to the memory, predict tokens
    with the embedding as the head's weight."""

    def __init__(self, embedding: nn.Embedding, layers: int) -> None:
        super().__init__()
        self.embedding = embedding
        layer = nn.TransformerDecoderLayer(WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerDecoder(layer, layers)

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        memory, target_in = batch
        length = target_in.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length, dtype=memory.dtype)
        hidden = self.layers(self.embedding(target_in), memory, tgt_mask=causal, tgt_is_causal=True)
        return F.linear(hidden, self.embedding.weight)


def build_blocks(dtype: torch.dtype = torch.float32) -> list[nn.Module]:
    """The model as two blocks, identical on every rank (fixed seed), the embedding shared."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    return [Encoder(embedding, 2).to(dtype), Decoder(embedding, 2).to(dtype)]


def loss_fn(logits: Tensor, target_out: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target_out.flatten())


def make_batch(step: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """Copy the source reversed: ((source, decoder input), decoder output)."""
    gen = torch.Generator().manual_seed(step)
    source = torch.randint(1, VOCAB, (16, 8), generator=gen)
    target = source.flip(1)
    start = torch.zeros(16, 1, dtype=torch.long)  # token 0 starts every target
    return (source, torch.cat([start, target[:, :-1]], dim=1)), target


def train(steps: int = 60, dtype: torch.dtype = torch.float32) -> list[float]:
    """Train on this rank of the process group; returns every step's loss."""
    pipe = Pipeline(build_blocks(dtype), loss_fn, schedule="1f1b", n_microbatches=4)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        inputs, targets = make_batch(step)
        losses.append(pipe.step(inputs, targets))
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        pipe.zero_grad()
        if pipe.rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        train()
        dist.destroy_process_group()
    else:
        losses = launch(train, 2)
        print(f"loss {losses[0][0]:.3f} -> {losses[0][-1]:.3f}")
