"""Schedules as a training run has them: one pipeline per process, with an optimizer step.

``run.py`` measures its variants in turns, many pipelines of one model in
one process; a training run holds one. This script launches two local ranks
(one thread each, gloo) per variant, trains the LLaMA-like model of a bench
regime for ``--steps`` steps with SGD, and keeps the median step after the
first two; the variants' launches alternate, ``--launches`` times each.
Prints each launch's median and the median over launches, and what
``schedule="auto"`` chose in each of its launches. The fixed variants get the
bench's partition; ``auto`` chooses its own.

    PYTHONPATH=src:tools .venv/bin/python benchmarks/auto_schedule/alone.py --regime small
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch
from twobp.sim.search import describe
from twobp_bench.config import REGIMES
from twobp_bench.matrix import stage_partition

VARIANTS: dict[str, dict[str, Any]] = {
    "zb-h2+2bp:fill (profiled)": {"schedule": "zb-h2", "two_bp_policy": "fill", "costs": "profile"},
    "interleaved-1f1b+2bp (V=2)": {"schedule": "interleaved-1f1b", "stages_per_rank": 2},
    "1f1b+2bp": {"schedule": "1f1b"},
    "gpipe+2bp": {"schedule": "gpipe"},
    "auto": {"schedule": "auto"},
}
"""The variants, as ``Pipeline`` options (2BP on, ``paper`` unless said)."""
WARM = 2
"""Steps left out of the median."""


def _rank_main(regime: str, m: int, name: str, steps: int) -> tuple[float, str]:
    torch.set_num_threads(1)
    info = REGIMES[regime]
    spec = build_model("llama", "tiny", seed=0, **dict(info.overrides))
    inputs, targets = spec.make_batch(info.microbatch_size * m, 0)
    options = dict(VARIANTS[name])
    if options.get("costs") == "profile" or options["schedule"] == "auto":
        options["example_input"] = inputs[: info.microbatch_size]
    if options["schedule"] != "auto":  # auto chooses its own partition
        n_stages = 2 * options.get("stages_per_rank", 1)
        kinds = [k.value for k in spec.block_kinds]
        options["partition"] = list(stage_partition(kinds, n_stages))
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        n_microbatches=m,
        device="cpu",
        num_threads=1,
        **options,
    )
    ran = ""
    if options["schedule"] == "auto":
        ran = f"{describe(pipe.plan.choice)}, partition {list(pipe.plan.partition)}"
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-4)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pipe.step(inputs if pipe.needs_inputs else None, targets if pipe.needs_targets else None)
        optimizer.step()
        pipe.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARM:]), ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="small")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    found: dict[str, list[float]] = {name: [] for name in VARIANTS}
    chosen: list[str] = []
    for _ in range(args.launches):
        for name in VARIANTS:
            result = launch(
                _rank_main,
                2,
                args.regime,
                args.microbatches,
                name,
                args.steps,
                threads_per_rank=1,
                timeout=900,
            )
            found[name].append(result[0][0])
            if result[0][1]:
                chosen.append(result[0][1])
    print(f"regime {args.regime}, m = {args.microbatches}, one pipeline per launch, medians (ms)")
    for name, times in sorted(found.items(), key=lambda kv: statistics.median(kv[1])):
        each = " ".join(f"{t * 1e3:6.1f}" for t in times)
        print(f"{name:<28} {each}   median {statistics.median(times) * 1e3:6.1f}")
    for i, choice in enumerate(chosen, 1):
        print(f"auto, launch {i}: {choice}")


if __name__ == "__main__":
    main()
