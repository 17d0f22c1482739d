"""What the tests of a Hugging Face export run: a pipeline of ``blocks(model)`` trained and saved,
and the same training in one process with plain PyTorch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from twobp.runtime import Pipeline

STEPS = 2
LR = 1e-2
VOCAB = 97


def build(kind: str, seed: int) -> nn.Module:
    """A tiny float64 GPT-2 or Qwen2 causal LM, its head tied to its token embedding, without
    dropout (a pipeline draws other masks than one process)."""
    import transformers

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "tie_word_embeddings": True}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.Qwen2Config(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, max_position_embeddings=16, **common,
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
    return model.double()


def batch(step: int) -> Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(step))


def train_and_save(kind: str, folder: str) -> None:
    """Train a pipeline of ``blocks(model)`` for :data:`STEPS` AdamW steps and save it."""
    from twobp.integrations.transformers import blocks, loss_function

    torch.set_num_threads(1)
    model = build(kind, seed=0)
    pipe = Pipeline(blocks(model), loss_function(model), schedule="1f1b", n_microbatches=2,
                    device="cpu", timeout=120.0)  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    for step in range(STEPS):
        ids = batch(step)
        pipe.step(ids, ids)
        optimizer.step()
        optimizer.zero_grad()
    pipe.save(Path(folder) / kind, optimizer, step=STEPS)
    pipe.close()


def trained_in_one_process(kind: str) -> dict[str, Tensor]:
    """The model's state dict after the same steps in one process, plain PyTorch."""
    from twobp.integrations.transformers import blocks, loss_function

    model = build(kind, seed=0)
    net = blocks(model)
    loss_fn = loss_function(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids = batch(step)
        loss_fn(net(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def every_kind(kinds: list[str], folder: str) -> Any:
    for kind in kinds:
        train_and_save(kind, folder)
