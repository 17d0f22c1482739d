"""What the ranks of twobp.split's tests run: models cut by split, trained as pipelines."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import twobp
from split_models import GPT, SEQ, VOCAB, Llama, ResNet
from twobp.runtime import Pipeline

N_MB, BATCH, STEPS, LR = 2, 4, 2, 0.1

CASES: dict[str, dict[str, Any]] = {
    "gpt": {"at": None, "partition": None},
    "llama": {"at": None, "partition": [2, 4]},
    "resnet": {"at": ["layer1.1", "layer2"], "partition": [2, 1]},
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = {"gpt": GPT, "llama": Llama, "resnet": ResNet}[name]()
    return model.double()


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def loss_of(name: str) -> Any:
    return F.cross_entropy if name == "resnet" else token_loss


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    if name == "resnet":
        images = torch.randn(BATCH, 3, 8, 8, generator=gen, dtype=torch.float64)
        return images, torch.randint(0, 5, (BATCH,), generator=gen)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def reference(name: str) -> dict[str, Any]:
    """One process, the whole model: the mean of the micro-batches' losses, as the pipeline."""
    model = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(name, step)
        total = sum(
            loss_of(name)(model(x), y)
            for x, y in zip(inputs.chunk(N_MB), targets.chunk(N_MB), strict=True)
        )
        loss = total / N_MB
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def train(name: str, folder: str) -> dict[str, Any]:
    """Train ``name`` cut by split on this group; save it; load it into a fresh pipeline."""
    case = CASES[name]
    pipe = Pipeline(
        twobp.split(build(name), at=case["at"]),
        loss_of(name),
        "1f1b",
        n_microbatches=N_MB,
        partition=case["partition"],
        device="cpu",
        timeout=60.0,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        losses.append(pipe.step(*batch(name, step)))
        optimizer.step()
        pipe.zero_grad()
    compute = pipe.timeline()
    waits = [s for s in pipe.timeline(waits=True) if s not in set(compute)]
    timeline = {
        "compute": [(s.rank, str(s.action), s.start, s.end) for s in compute],
        "waits": [(s.rank, str(s.action), s.start, s.end) for s in waits],
    }
    pipe.save(f"{folder}/{name}", optimizer)
    names = [n for n, _ in pipe.named_parameters()]
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    again = Pipeline(
        twobp.split(build(name, seed=1), at=case["at"]),
        loss_of(name),
        "1f1b",
        n_microbatches=N_MB,
        device="cpu",
        timeout=60.0,
    )
    again.load(f"{folder}/{name}")
    loaded = again.state_dict()
    again.close()
    return {
        "losses": losses,
        "state": state,
        "names": names,
        "loaded": loaded,
        "timeline": timeline,
    }


def train_all(folder: str) -> dict[str, Any]:
    return {name: train(name, folder) for name in CASES}
