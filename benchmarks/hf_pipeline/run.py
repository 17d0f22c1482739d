"""2BP on and off for a Hugging Face model on 2 ranks, under autocast: step time and throughput.

Each rank builds the same ``transformers`` model from a small configuration
(``twobp.integrations.transformers.build_model``, head untied, byte vocabulary),
cut by ``blocks(model)``, twice: one ``Pipeline`` with 2BP and one without,
each on a process group of its own, both with ``autocast=`` the chosen dtype.
After a warm-up the two take steps in turn (which one goes first alternates),
so that the machine's load weighs on both alike; a step is ``pipe.step`` and
``zero_grad`` (the optimizer is the same with and without 2BP and is left
out). Printed: the median step time of each over the measured steps, in
tokens/s too, and their ratio. Needs ``transformers``; 1 thread per rank.

    python benchmarks/hf_pipeline/run.py [--family llama] [--size small] [--autocast bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import twobp
from twobp.integrations.transformers import FAMILIES, SIZES, blocks, build_model, loss_function

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "none": None}


def _pipeline(args: argparse.Namespace, two_bp: bool) -> twobp.Pipeline:
    torch.manual_seed(0)  # the same model on every rank, and with and without 2BP
    model = build_model(
        args.family, args.size, tied=False, vocab_size=256, max_positions=args.seq_len
    )
    return twobp.Pipeline(
        list(blocks(model)),
        loss_function(model),
        schedule=args.schedule,
        n_microbatches=args.microbatches,
        two_bp=two_bp,
        group=dist.new_group(),
        num_threads=1,
        autocast=DTYPES[args.autocast],
    )


def _rank(args: argparse.Namespace) -> dict[str, list[float]]:
    """On every rank: the step times of each pipeline, measured steps only."""
    pipes = {"2BP on": _pipeline(args, True), "2BP off": _pipeline(args, False)}
    times: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for step in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=gen)
        for name in names if step % 2 == 0 else reversed(names):
            pipe = pipes[name]
            start = time.perf_counter()
            pipe.step(ids, ids)
            pipe.zero_grad()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    for pipe in pipes.values():
        pipe.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--autocast", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    results: list[Any] = twobp.launch(_rank, 2, args, threads_per_rank=1)
    times = results[0]
    tokens = args.batch_size * args.seq_len
    print(
        f"hf-{args.family}-{args.size}, {args.schedule}, {args.microbatches} micro-batches of "
        f"{args.batch_size // args.microbatches} x {args.seq_len} tokens, autocast "
        f"{args.autocast}, 2 ranks x 1 thread; median of {args.steps} steps each, in turn"
    )
    print("| 2BP | median step s | tokens/s |")
    print("|---|---:|---:|")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"| {name.removeprefix('2BP ')} | {median:.4f} | {tokens / median:.0f} |")
    print(f"2BP on / off step time: {medians['2BP on'] / medians['2BP off']:.3f}")


if __name__ == "__main__":
    main()
