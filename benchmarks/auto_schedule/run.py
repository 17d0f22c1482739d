"""``schedule="auto"`` against the fixed twobp schedules, in one run.

Two local ranks (one thread each, gloo) build the LLaMA-like model of a
``twobp bench`` regime (``large``: 256 rows per GEMM, ``small``: 32), then one
pipeline per variant: ``schedule="auto"`` (it profiles the blocks,
simulates every schedule, 2BP policy, W group cap and stage count, and runs
the fastest few in trial steps), the same with ``auto_trials=0`` (the
simulator's choice), and the fixed schedules with and without 2BP. The
variants take turns, one step each per round, so that a change of machine
load touches them all alike. Prints
per variant the median step time and samples/s, each variant against the
best fixed one, and what ``auto`` chose and predicted. The fixed variants
get the bench's partition (body blocks split evenly, embedding and head
with the first and last stage); ``auto`` balances the blocks by its profile.

    PYTHONPATH=src:tools .venv/bin/python benchmarks/auto_schedule/run.py --regime small
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch
from twobp.runtime.setup.auto.plan import CONTENDERS
from twobp_bench.config import REGIMES
from twobp_bench.matrix import TWOBP, Variant, model_stages, stage_partition

FIXED = (
    Variant(TWOBP, "gpipe"),
    Variant(TWOBP, "gpipe", two_bp=True, policy="paper"),
    Variant(TWOBP, "1f1b"),
    Variant(TWOBP, "1f1b", two_bp=True, policy="paper"),
    Variant(TWOBP, "interleaved-1f1b", two_bp=True, policy="paper"),
    Variant(TWOBP, "zb-h1", two_bp=True),
    Variant(TWOBP, "zb-h2", two_bp=True),
    Variant(TWOBP, "zb-v", two_bp=True),
)
"""The fixed schedules; the split ones (``zb-*``) place W as they are written."""
PROFILED = (
    Variant(TWOBP, "zb-h2", two_bp=True, policy="fill"),
    Variant(TWOBP, "zb-v", two_bp=True, policy="fill"),
)
"""Split schedules whose W the measured costs place, grouped (``costs="profile"``)."""
UNTRIED = "auto, no trials"
"""``schedule="auto"`` with ``auto_trials=0``: the simulator's choice, unmeasured."""


def _label(variant: Variant) -> str:
    label = variant.label.removeprefix(f"{TWOBP} ")
    return f"{label} (profiled)" if variant in PROFILED else label


def _rank_main(regime: str, m: int, rounds: int, memory_limit: str | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    info = REGIMES[regime]
    spec = build_model("llama", "tiny", seed=0, **dict(info.overrides))
    inputs, targets = spec.make_batch(info.microbatch_size * m, 0)
    example = inputs[: info.microbatch_size]
    pipes: dict[str, Pipeline] = {}
    planning: dict[str, float] = {}
    for name, trials in (("auto", CONTENDERS), (UNTRIED, 0)):
        started = time.perf_counter()
        pipes[name] = Pipeline(
            copy.deepcopy(spec.blocks),
            spec.loss_fn,
            schedule="auto",
            n_microbatches=m,
            example_input=example,
            memory_limit=memory_limit,
            device="cpu",
            num_threads=1,
            auto_trials=trials,
        )
        planning[name] = time.perf_counter() - started
    kinds = [k.value for k in spec.block_kinds]
    for variant in (*FIXED, *PROFILED):
        # The bench's partition: body blocks split evenly, embedding and head at the ends.
        partition = stage_partition(kinds, model_stages(variant, 2))
        profiled = {"costs": "profile", "example_input": example} if variant in PROFILED else {}
        pipes[_label(variant)] = Pipeline(
            copy.deepcopy(spec.blocks),
            spec.loss_fn,
            schedule=variant.schedule,
            n_microbatches=m,
            two_bp=variant.two_bp,
            two_bp_policy=variant.policy or "paper",
            partition=list(partition),
            device="cpu",
            num_threads=1,
            **profiled,
        )
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(rounds + 1):
        for name, pipe in pipes.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            pipe.step(
                inputs if pipe.needs_inputs else None, targets if pipe.needs_targets else None
            )
            torch.distributed.barrier()
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
            pipe.zero_grad()
    plan, untried = pipes["auto"].plan, pipes[UNTRIED].plan
    assert plan is not None and untried is not None
    return {
        "times": times,
        "plan": str(plan),
        "predicted": plan.predicted_step_time,
        "planning_s": planning,
        "schedule": str(pipes["auto"].schedule),
        "untried": untried.summary(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="large")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--memory-limit", default=None)
    args = parser.parse_args()
    results = launch(
        _rank_main,
        2,
        args.regime,
        args.microbatches,
        args.rounds,
        args.memory_limit,
        threads_per_rank=1,
        timeout=1800,
    )
    out = results[0]
    samples = REGIMES[args.regime].microbatch_size * args.microbatches
    medians = {n: statistics.median(t) for n, t in out["times"].items()}
    best_fixed = min((t, n) for n, t in medians.items() if not n.startswith("auto"))
    print(out["plan"])
    print(
        f"planning took {out['planning_s']['auto']:.1f} s on rank 0 (profile, search, trial "
        f"steps); {out['planning_s'][UNTRIED]:.1f} s without trial steps"
    )
    print(f"auto runs: {out['schedule']}")
    print(f"{UNTRIED}: {out['untried']}")
    print()
    print(f"regime {args.regime}, m = {args.microbatches}, {args.rounds} rounds, medians")
    print(f"{'variant':<30} {'step ms':>9} {'samples/s':>10} {'vs best fixed':>14}")
    for name, t in sorted(medians.items(), key=lambda kv: kv[1]):
        print(f"{name:<30} {t * 1e3:9.1f} {samples / t:10.1f} {best_fixed[0] / t:13.3f}x")
    print(
        f"auto predicted {out['predicted'] * 1e3:.1f} ms, measured {medians['auto'] * 1e3:.1f} ms; "
        f"auto / best fixed ({best_fixed[1]}): {best_fixed[0] / medians['auto']:.3f}x "
        f"throughput; {UNTRIED}: {best_fixed[0] / medians[UNTRIED]:.3f}x"
    )


if __name__ == "__main__":
    main()
