"""The encoder-decoder example: two hand-written blocks, one embedding shared by both ranks.

On 2 gloo ranks it must train as the same two blocks do in one process with plain
PyTorch (float64, loss of every step), the shared embedding's gradient summed over the
encoder, the decoder and the head.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from example_workers import train_encoder_decoder
from repo_scripts import load_script
from twobp.runtime import launch

example = load_script("examples/encoder_decoder.py")
STEPS = 3
pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _plain(steps: int) -> list[float]:
    net = nn.Sequential(*example.build_blocks(torch.float64))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        inputs, targets = example.make_batch(step)
        loss = example.loss_fn(net(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def test_the_encoder_decoder_pipeline_trains_as_plain_pytorch():
    ranks = launch(train_encoder_decoder, 2, STEPS, torch.float64, threads_per_rank=1, timeout=300)
    want = _plain(STEPS)
    for losses in ranks:
        assert losses == pytest.approx(want, rel=0, abs=1e-10)
