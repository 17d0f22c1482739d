"""What a step costs when its sequence length changes, once the pipeline has seen both.

Two local ranks (gloo, one thread each) run the tiny LLaMA-like model with 1F1B
and 2BP. Three pipelines on the same blocks take turns step by step (each
claims the blocks for its step), in rounds after a warm-up:

  fixed short   every step of --short tokens
  fixed long    every step of --long tokens
  alternating   --short and --long tokens in turn

The alternating pipeline learns both layouts in its first two steps and then
runs from its cache: no layout message, receives posted ahead. The figure that
matters is the ratio of its mean step time to the mean of the two fixed
pipelines' (1.00: no cost), the minimum and the median over the rounds.

    .venv/bin/python benchmarks/changing_shapes/run.py [--rounds 30] [--short 64 --long 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch


def _batch(step: int, rows: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def measure(args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: each pipeline's step times by round, and the alternating one's
    layout messages after the warm-up."""
    spec = build_model("llama", "tiny", seed=0, seq_len=args["long"], vocab_size=256)
    common = dict(schedule="1f1b", n_microbatches=args["microbatches"], device="cpu")
    pipes: dict[str, Pipeline] = {}
    for name in ("fixed short", "fixed long", "alternating"):
        for other in pipes.values():
            other.release_blocks()
        pipes[name] = Pipeline(spec.blocks, spec.loss_fn, **common)  # type: ignore[arg-type]
    for pipe in pipes.values():
        pipe.release_blocks()
    lengths = {"fixed short": [args["short"]], "fixed long": [args["long"]]}
    lengths["alternating"] = [args["short"], args["long"]]
    times: dict[str, list[float]] = {name: [] for name in pipes}
    messages = 0
    for step in range(args["warmup"] + 2 * args["rounds"]):
        for name, pipe in pipes.items():
            seq = lengths[name][step % len(lengths[name])]
            inputs, targets = _batch(step, args["rows"], seq, 256)
            pipe.claim_blocks()
            start = time.perf_counter()
            pipe.step(inputs, targets)
            seconds = time.perf_counter() - start
            pipe.zero_grad()
            pipe.release_blocks()
            if step >= args["warmup"]:
                times[name].append(seconds)
                if name == "alternating":
                    messages += pipe.step_times.layout_messages
    for pipe in pipes.values():
        pipe.close()
    return {"times": times, "messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="pairs of steps measured")
    parser.add_argument("--warmup", type=int, default=4, help="steps not measured")
    parser.add_argument("--short", type=int, default=64, help="tokens of the short steps")
    parser.add_argument("--long", type=int, default=128, help="tokens of the long steps")
    parser.add_argument("--rows", type=int, default=8, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=4)
    args = vars(parser.parse_args())
    args["warmup"] += args["warmup"] % 2  # the first step measured is a short one
    results = launch(measure, 2, args, threads_per_rank=1)
    times = results[0]["times"]
    # Per pair of steps (one short, one long): the fixed pipelines' pair against the
    # alternating one's.
    pairs = args["rounds"]
    short, long, alt = times["fixed short"], times["fixed long"], times["alternating"]
    fixed = [short[2 * r] + long[2 * r + 1] for r in range(pairs)]
    alternating = [alt[2 * r] + alt[2 * r + 1] for r in range(pairs)]
    ratios = [a / f for a, f in zip(alternating, fixed, strict=True)]
    of_minima = (min(alt[0::2]) + min(alt[1::2])) / (min(short) + min(long))
    print(
        f"llama tiny, 2 ranks, 1f1b, {args['microbatches']} micro-batches of "
        f"{args['rows'] // args['microbatches']} rows, {args['short']} and {args['long']} tokens, "
        f"{pairs} rounds after {args['warmup']} warm-up steps"
    )
    for name, values in times.items():
        print(
            f"  {name:12s} {1e3 * min(values):7.2f} ms min  "
            f"{1e3 * statistics.median(values):7.2f} ms median per step"
        )
    print(
        f"  alternating / fixed, per pair of steps: {min(ratios):.3f} min, "
        f"{statistics.median(ratios):.3f} median; of the minima {of_minima:.3f}"
    )
    sent = sum(r["messages"] for r in results)
    print(f"  layout messages of the alternating pipeline after the warm-up: {sent}")


if __name__ == "__main__":
    main()
