"""Step time of the mixture-of-experts decoder: 2BP concatenating each expert's W over the
micro-batches, 2BP with one W per micro-batch (no concatenation), and no 2BP.

Two ranks of one thread each, 1f1b; the three pipelines are timed in interleaved rounds and
the ratios are medians of each round's paired ratios.

    python benchmarks/moe_experts/run.py --size tiny
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch

VARIANTS = {
    "2BP, expert W concatenated": {"two_bp": True, "weight_group_size": None},
    "2BP, one W per micro-batch": {"two_bp": True, "weight_group_size": 1},
    "no 2BP": {"two_bp": False, "weight_group_size": None},
}


def _session(size: str, batch: int, n_mb: int, rounds: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    spec = build_model("moe", size, seed=0)
    pipes = {}
    for name, options in VARIANTS.items():
        pipes[name] = Pipeline(
            build_model("moe", size, seed=0).blocks,
            spec.loss_fn,
            schedule="1f1b",
            n_microbatches=n_mb,
            device="cpu",
            example_input=spec.example_input(batch // n_mb),
            **options,
        )
    x, y = spec.make_batch(batch, 0)
    for pipe in pipes.values():  # warm-up
        pipe.step(x, y)
        pipe.zero_grad()
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(rounds):
        for name, pipe in pipes.items():
            start = time.perf_counter()
            for _ in range(steps):
                pipe.step(x, y)
                pipe.zero_grad()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    per_rank = launch(
        _session,
        2,
        args.size,
        args.batch,
        args.microbatches,
        args.rounds,
        args.steps,
        threads_per_rank=1,
        timeout=1200,
    )
    # A step ends on every rank together: rank 0's times are the step's.
    times = per_rank[0]
    config = build_model("moe", args.size, device="meta").config
    tokens = args.batch // args.microbatches * config.seq_len
    rows = tokens * config.top_k / config.n_experts
    base = times["no 2BP"]
    print(f"moe-{args.size}, 1f1b, 2 ranks x 1 thread, batch {args.batch}, m={args.microbatches}")
    print(
        f"rows per expert GEMM: {rows:.0f} per micro-batch, {rows * args.microbatches:.0f} "
        "concatenated (on average)"
    )
    print("| variant | step (ms) | vs no 2BP |")
    print("|---|---|---|")
    for name, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, base, strict=True))
        print(f"| {name} | {1000 * statistics.median(t):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
