"""1F1B-1 (m = p = 2) with and without 2BP: the step against its critical path's compute.

Two local ranks (gloo, one thread each, each pinned to its own core) run 1f1b with
2 micro-batches on the bench's LLaMA regime, with and without 2BP, alternated step by
step on one copy of the blocks. From each variant's own action times (means over the
timed steps, per stage, kind and micro-batch count), the simulator replays the schedule
with free transfers and nothing between actions: the step this compute gives a runtime
that costs nothing itself. A third replay runs the 2BP schedule with the split stage's
``F`` at plain autograd's (the engine's capture in ``F`` made free). Printed: each
action's mean time, and per variant the measured step and the replays, with the ratio
of the two variants for each.

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline_overhead/critical_path.py \\
        --regime small --rounds 30
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch
from twobp_bench.config import REGIMES
from twobp_bench.matrix import stage_partition
from twobp_bench.simcheck import replayed_step

MICROBATCHES = 2


def measure(regime: str, rounds: int, warmup: int) -> dict[str, Any]:
    """On every rank: each variant's step times and its actions' times (all ranks')."""
    rank = torch.distributed.get_rank()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    spec = build_model("llama", "tiny", seed=0, **dict(REGIMES[regime].overrides))
    partition = list(stage_partition([k.value for k in spec.block_kinds], 2))
    pipes = {}
    for two_bp in (False, True):
        for other in pipes.values():
            other.release_blocks()
        pipes[two_bp] = Pipeline(
            list(spec.blocks),
            spec.loss_fn,
            schedule="1f1b",
            n_microbatches=MICROBATCHES,
            two_bp=two_bp,
            partition=partition,
            num_threads=1,
        )
    for pipe in pipes.values():
        pipe.release_blocks()
    inputs, targets = spec.make_batch(REGIMES[regime].microbatch_size * MICROBATCHES, 0)
    steps: dict[bool, list[float]] = defaultdict(list)
    actions: dict[bool, dict[str, list[float]]] = {tb: defaultdict(list) for tb in pipes}
    for round_ in range(warmup + rounds):
        for two_bp, pipe in pipes.items():
            pipe.claim_blocks()
            torch.distributed.barrier()
            start = time.perf_counter()
            pipe.step(inputs if rank == 0 else None, targets if rank == 1 else None)
            seconds = time.perf_counter() - start
            pipe.zero_grad()
            pipe.release_blocks()
            if round_ < warmup:
                continue
            steps[two_bp].append(seconds)
            for span in pipe.timeline():
                a = span.action
                actions[two_bp][f"{a.stage}:{a.kind.value}:{len(a.microbatches)}"].append(
                    span.end - span.start
                )
    lists = {
        tb: {r: [str(a) for a in acts] for r, acts in p.schedule.actions.items()}
        for tb, p in pipes.items()
    }
    for pipe in pipes.values():
        pipe.close()
    return {
        "steps": dict(steps),
        "actions": {tb: dict(a) for tb, a in actions.items()},
        "lists": lists,
    }


def replay(lists: Mapping[int, Sequence[str]], times: Mapping[str, Sequence[float]]) -> float:
    """The step of ``lists`` with each action taking the mean of its ``times`` (by
    ``"stage:kind:micro-batches"``) and nothing else taking any: free transfers."""
    return replayed_step(lists, (0, 1), MICROBATCHES, times, (0.0, math.inf)).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="small")
    parser.add_argument("--rounds", type=int, default=30, help="timed steps of each variant")
    parser.add_argument("--warmup", type=int, default=3, help="steps of each not timed")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs 2 cores: one per rank")
    result = launch(measure, 2, args.regime, args.rounds, args.warmup, threads_per_rank=1)[0]
    means = {
        tb: {k: statistics.fmean(v) for k, v in acts.items()}
        for tb, acts in result["actions"].items()
    }
    fused, split = means[False], means[True]
    timed = result["actions"]
    # The split stage (the last) with the F of plain autograd.
    plain_forward = {**timed[True], "1:F:1": timed[False]["1:F:1"]}
    step = {tb: statistics.median(s) for tb, s in result["steps"].items()}
    rows = [
        ("measured step", step[False], step[True]),
        (
            "replay: free transfers, nothing between actions",
            replay(result["lists"][False], timed[False]),
            replay(result["lists"][True], timed[True]),
        ),
        (
            "replay, the split stage's F at plain autograd's",
            replay(result["lists"][False], timed[False]),
            replay(result["lists"][True], plain_forward),
        ),
    ]
    print(f"1f1b, m = p = 2, regime {args.regime}, {args.rounds} steps of each (ms; action means)")
    for name in sorted({*fused, *split}):
        cells = [f"{1e3 * t[name]:7.2f}" if name in t else "      -" for t in (fused, split)]
        print(f"  {name:8s} no 2BP {cells[0]}   2BP {cells[1]}")
    for name, without, with_2bp in rows:
        print(
            f"{name:50s} no 2BP {1e3 * without:7.1f}  2BP {1e3 * with_2bp:7.1f}  "
            f"ratio {without / with_2bp:.3f}"
        )


if __name__ == "__main__":
    main()
