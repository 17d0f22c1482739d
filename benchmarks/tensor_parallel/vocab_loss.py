"""The vocabulary-parallel loss against gathered logits: the logits' bytes and the step.

A LLaMA-like model (``MODEL``: 4 decoders of width 512, a vocabulary of 32,000) on 2
tensor-parallel ranks, the decoders split as ``tensor_parallel_plan("llama")`` says, the
embedding by vocabulary, and the head by columns: its logits either gathered over the
group before ``F.cross_entropy`` (``"colwise_gather_output"``) or left split for the
vocabulary-parallel cross-entropy (``"colwise_loss_parallel"``). 1f1b with 2BP, one
pipeline rank, float32.

Per rank, one step watched by a dispatch mode: the largest tensor made whose last dim is
the whole vocabulary, and the largest whose last dim is the rank's half of it (bytes). Then
the steps timed, the two variants taking turns step by step; medians of the timed rounds
(the slower rank's step, as every rank waits for the other). One thread per rank, gloo.

    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel/vocab_loss.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from twobp.models import build_model, tensor_parallel_plan
from twobp.runtime import Pipeline, launch

MODEL = {"dim": 512, "n_heads": 8, "ffn_dim": 1376, "n_layers": 4, "seq_len": 64}
VOCAB = 32000
TENSOR_PARALLEL = 2
HEADS = {"gathered": "colwise_gather_output", "vocabulary-parallel": "colwise_loss_parallel"}


class _Largest(TorchDispatchMode):
    """The largest tensor made whose last dim is the vocabulary (``whole``) or its part."""

    def __init__(self, vocab: int, part: int) -> None:
        super().__init__()
        self.sizes = {vocab: "whole", part: "part"}
        self.largest = {"whole": 0, "part": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.sizes:
                key = self.sizes[t.shape[-1]]
                self.largest[key] = max(self.largest[key], t.numel() * t.element_size())
        return out


def _rank(microbatches: int, batch: int, rounds: int) -> dict[str, Any]:
    spec = build_model("llama", "small", vocab_size=VOCAB, **MODEL)
    inputs, targets = spec.make_batch(batch, 0)
    pipes = {}
    for name, head in HEADS.items():
        plan = {**tensor_parallel_plan("llama"), "embed": "rowwise", "output": head}
        pipes[name] = Pipeline(
            copy.deepcopy(spec.blocks),
            spec.loss_fn,
            "1f1b",
            n_microbatches=microbatches,
            tensor_parallel=TENSOR_PARALLEL,
            tensor_parallel_plan=plan,
        )
    logits, losses = {}, {}
    for name, pipe in pipes.items():
        watch = _Largest(VOCAB, VOCAB // TENSOR_PARALLEL)
        with watch:
            pipe.step(inputs, targets)
        stats = pipe.memory_stats()
        logits[name] = {**watch.largest, "held": stats["activations"] + stats["stash"]}
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for round_ in range(rounds + 2):
        for name, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            losses[name] = pipe.step(inputs, targets)
            dist.barrier()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {"logits": logits, "medians": medians, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    results = launch(
        _rank,
        TENSOR_PARALLEL,
        args.microbatches,
        args.batch,
        args.rounds,
        threads_per_rank=1,
        timeout=1800,
    )
    tokens = args.batch // args.microbatches * MODEL["seq_len"]
    losses = results[0]["losses"]
    spread = max(losses.values()) - min(losses.values())
    print(f"difference of the two losses (float32): {spread:.2e}")
    print(f"{tokens} tokens per micro-batch, vocabulary {VOCAB}, T {TENSOR_PARALLEL}")
    print("largest tensor per rank with the whole vocabulary [.., V] or its part [.., V/T]")
    print("as last dim; held: memory_stats' peaks of activations and stash (between passes)")
    print("| head | largest [.., V] | largest [.., V/T] | held | step ms |")
    print("|---|---:|---:|---:|---:|")
    for name in HEADS:
        seen = results[0]["logits"][name]
        step = results[0]["medians"][name] * 1e3
        row = f"{seen['whole']:,} B | {seen['part']:,} B | {seen['held']:,} B | {step:.1f}"
        print(f"| {name} | {row} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
