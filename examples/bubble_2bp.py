"""Measure the pipeline bubble and throughput of a schedule with and without 2BP.

Starts 2 local ranks (1 thread each by default) and trains a reference model
with the schedule fused (``B``), split by each 2BP policy, and as ``two_bp``
left unset does (``default``: split on the stages where a profile of the
blocks says it pays; the choice is printed). The
configurations take turns step by step, so that a machine shared with other
work slows them alike. For each it prints the measured bubble ratio (idle
share of the step's compute timeline, averaged over ranks, from the runtime's
own timeline) and the throughput:

    python examples/bubble_2bp.py --model llama --size tiny --schedule 1f1b --policies paper

The first rounds are warm-up and not measured; figures are medians over steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch
from twobp.timeline import bubble_ratio

DEFAULT = "default"
"""The configuration that leaves two_bp unset."""


def measure_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train every configuration on this rank, in turns; figures of the measured steps."""
    policies: list[str | None] = [None, *args.policies.split(",")]
    runs = []
    for policy in [*policies, DEFAULT]:
        spec = build_model(args.model, args.size)
        first = spec.make_batch(args.batch_size, 0)[0][: args.batch_size // args.microbatches]
        pipe = Pipeline(
            spec.blocks,
            spec.loss_fn,
            schedule=args.schedule,
            n_microbatches=args.microbatches,
            # DEFAULT: two_bp unset, with the first micro-batch to profile on.
            two_bp=None if policy == DEFAULT else policy is not None,
            two_bp_policy="paper" if policy in (None, DEFAULT) else policy,
            example_input=first if policy == DEFAULT else None,
        )
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        runs.append({"spec": spec, "pipe": pipe, "opt": optimizer, "seconds": [], "bubbles": []})
    for step in range(args.warmup + args.steps):
        for run in runs:
            inputs, targets = run["spec"].make_batch(args.batch_size, step)
            start = time.perf_counter()
            run["pipe"].step(inputs, targets)
            run["opt"].step()
            run["pipe"].zero_grad()
            elapsed = time.perf_counter() - start
            spans = run["pipe"].timeline()
            if step >= args.warmup:
                run["seconds"].append(elapsed)
                run["bubbles"].append(bubble_ratio(spans))
    return [
        {
            "schedule": ("default: " if run["pipe"].two_bp_choice else "")
            + run["pipe"].schedule.name,
            "choice": run["pipe"].two_bp_choice,
            "step_s": statistics.median(run["seconds"]),
            "bubble": statistics.median(run["bubbles"]),
        }
        for run in runs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    fused = results[0]["step_s"]
    print(f"{'schedule':<32} {'bubble':>7} {'step (s)':>9} {'samples/s':>10} {'vs no 2BP':>10}")
    for r in results:
        rate = args.batch_size / r["step_s"]
        print(
            f"{r['schedule']:<32} {r['bubble']:>7.1%} {r['step_s']:>9.3f} {rate:>10.1f} "
            f"{fused / r['step_s']:>9.2f}x"
        )
    choice = results[-1]["choice"]
    if choice is not None:
        print(f"default: {choice.summary()}")


if __name__ == "__main__":
    main()
