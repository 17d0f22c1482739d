"""Train a small MLP as a 2-stage pipeline: 1F1B with 2-stage backpropagation.

Run it either way:

    torchrun --nproc-per-node 2 examples/train_mlp.py   # torchrun starts the 2 ranks
    python examples/train_mlp.py                        # starts 2 local ranks itself

Every rank builds the same model; the pipeline keeps the blocks of its own
stage, and ``step`` returns the batch's mean loss on every rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twobp.runtime import Pipeline, launch


def build_blocks() -> list[nn.Module]:
    """The whole model as a list of blocks, identical on every rank (fixed seed)."""
    torch.manual_seed(0)
    hidden = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(7)]
    return [*hidden, nn.Linear(32, 1)]


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 64 samples of a smooth function to fit (the same on every rank)."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 32, generator=gen)
    return x, torch.tanh(x[:, :8].sum(dim=1, keepdim=True) / 2)


def train(steps: int = 60) -> float:
    """Train on this rank of the process group; returns the last loss."""
    pipe = Pipeline(
        build_blocks(),
        F.mse_loss,
        schedule="1f1b",
        n_microbatches=4,
        two_bp=True,  # backward split into I and W, W placed by the 2BP policy
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    loss = float("nan")
    for step in range(steps):
        inputs, targets = make_batch(step)
        loss = pipe.step(inputs, targets)  # forward and backward of all micro-batches
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        pipe.zero_grad()
        if pipe.rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss:.4f}")
    if pipe.rank == 0:
        print(f"rank 0 holds blocks {list(pipe.stage_blocks[0])}; final loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        train()
        dist.destroy_process_group()
    else:  # started alone: run 2 local ranks and collect their results
        losses = launch(train, 2)
        print(f"final loss on each rank: {losses}")
