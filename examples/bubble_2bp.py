"""Measure the pipeline bubble and throughput of a schedule with and without 2BP.

Starts 2 local ranks (1 thread each by default) and trains a reference model
for a few steps with each configuration, then prints, per configuration, the
measured bubble ratio (idle fraction of the step, averaged over ranks, from
the runtime's own timeline) and the throughput:

    python examples/bubble_2bp.py --model llama --size tiny --schedule 1f1b --policies paper

The first steps are warm-up and not measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch
from twobp.timeline import bubble_ratio, makespan


def measure(args: argparse.Namespace, policy: str | None) -> dict[str, Any]:
    """Train on this rank (2BP with ``policy``, or fused if None); figures of the measured steps."""
    spec = build_model(args.model, args.size)
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        schedule=args.schedule,
        n_microbatches=args.microbatches,
        two_bp=policy is not None,
        two_bp_policy=policy or "paper",
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    seconds, bubbles, spans = [], [], []
    for step in range(args.warmup + args.steps):
        inputs, targets = spec.make_batch(args.batch_size, step)
        start = time.perf_counter()
        pipe.step(inputs, targets)
        optimizer.step()
        pipe.zero_grad()
        elapsed = time.perf_counter() - start
        spans = pipe.timeline()
        if step >= args.warmup:
            seconds.append(elapsed)
            bubbles.append(bubble_ratio(spans))
    return {
        "schedule": pipe.schedule.name,
        "step_s": statistics.median(seconds),
        "bubble": statistics.median(bubbles),
        "makespan_s": makespan(spans),
    }


def measure_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Without 2BP, then with each policy, in one process group."""
    return [measure(args, None)] + [measure(args, p) for p in args.policies.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--policies", default="paper", help="2BP policies, comma-separated")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()
    results = launch(measure_all, args.ranks, args, threads_per_rank=args.threads)[0]
    print(
        f"{args.model}-{args.size}, {args.ranks} ranks x {args.threads} thread(s), "
        f"batch {args.batch_size} in {args.microbatches} micro-batches"
    )
    print(f"{'schedule':<24} {'bubble':>7} {'step (s)':>9} {'samples/s':>10}")
    for r in results:
        rate = args.batch_size / r["step_s"]
        print(f"{r['schedule']:<24} {r['bubble']:>7.1%} {r['step_s']:>9.3f} {rate:>10.1f}")
    print("bubble: idle share of the step's compute timeline, mean over ranks (median of steps)")


if __name__ == "__main__":
    main()
