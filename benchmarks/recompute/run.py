"""What recomputation saves and costs: ``Pipeline(recompute=...)`` on 2 ranks, 1 thread each.

1. Memory of an MLP: a stage of several MLP blocks per rank, 1F1B with 2BP
   (paper), m = 8, float32. For every recompute mode, ``memory_stats()`` of
   each rank after a step, and its activations and stash against no recompute.
2. The large regime of ``twobp bench`` (LLaMA-like, dim 256, 4 decoder layers,
   256 rows per GEMM, the bench's partition), m = 8: plain 1F1B, 1F1B with 2BP,
   and 1F1B with 2BP and ``recompute="derivatives"`` (with and without a cap on
   the W groups), run in turn round after round. Throughput is the median step
   time; the step peak is that of ``twobp bench`` (the allocations of one step
   under the profiler, beyond what was held before it, the largest rank).
   Ratios come from the same run.
3. ``recompute="auto"`` in the same regime, under a ``memory_limit`` that holds
   half of the stashes: the blocks are profiled once (``costs="profile"``), and
   the limit is the simulated peak of 1F1B with 2BP less half the stashes its
   fullest rank holds there. Run in turn, round after round: 1F1B with 2BP
   placed by those costs (no recomputation, over the limit), the same with
   ``recompute="derivatives"``, the same with ``recompute="auto"`` (the fewest
   stashes rebuilt that fit), and ``schedule="auto"`` with ``recompute="auto"``
   (the planner ranks rebuilding against every schedule and placement that fits).

    PYTHONPATH=src:tools .venv/bin/python benchmarks/recompute/run.py
    PYTHONPATH=src:tools .venv/bin/python benchmarks/recompute/run.py auto   # 3. only
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twobp.models import build_model
from twobp.runtime import Pipeline, launch
from twobp.timeline import bubble_ratio
from twobp_bench.config import REGIMES
from twobp_bench.matrix import stage_partition
from twobp_bench.measure import step_peak_bytes

MODES = (None, "activations", "derivatives", "all")
N_MB = 8
WARMUP = 2
ROUNDS = 7


def alternate(
    pipes: dict[str, Pipeline], inputs: Any, targets: Any
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Step every pipeline in turn, round after round: each one's timed steps (seconds)
    and its step peak, measured in the last warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in pipes}
    peaks: dict[str, int] = {}
    for round_index in range(WARMUP + ROUNDS):
        for name, pipe in pipes.items():
            dist.barrier()
            if round_index == WARMUP - 1:
                peaks[name] = step_peak_bytes(lambda p=pipe: p.step(inputs, targets), pipe.device)
            else:
                start = time.perf_counter()
                pipe.step(inputs, targets)
                dist.barrier()
                if round_index >= WARMUP:
                    times[name].append(time.perf_counter() - start)
            pipe.zero_grad()
    return times, peaks


def mlp_blocks(n_blocks: int = 8, width: int = 256, hidden: int = 1024) -> list[nn.Module]:
    """MLP blocks (linear, GELU, linear, layer norm) and a linear head, from a fixed seed."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(
            nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width), nn.LayerNorm(width)
        )
        for _ in range(n_blocks)
    ]
    return [*blocks, nn.Linear(width, 16)]


def mlp_memory() -> dict[str, dict[str, int]]:
    """On every rank: ``memory_stats()`` of one step per recompute mode."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_MB * 64, 256, generator=gen)
    y = torch.randn(N_MB * 64, 16, generator=gen)
    out = {}
    for mode in MODES:
        pipe = Pipeline(
            mlp_blocks(), F.mse_loss, "1f1b", N_MB, two_bp=True, recompute=mode, device="cpu"
        )
        for _ in range(2):
            pipe.step(x, y)
            pipe.zero_grad()
        out[str(mode)] = pipe.memory_stats()
        pipe.close()
    return out


VARIANTS = {
    "1f1b": {"two_bp": False},
    "1f1b+2bp": {"two_bp": True},
    "1f1b+2bp+derivatives": {"two_bp": True, "recompute": "derivatives"},
    "1f1b+2bp+derivatives, W groups of 2": {
        "two_bp": True,
        "recompute": "derivatives",
        "weight_group_size": 2,
    },
    "1f1b+2bp+derivatives, W groups of 1": {
        "two_bp": True,
        "recompute": "derivatives",
        "weight_group_size": 1,
    },
}


def large_regime() -> dict[str, Any]:
    """On every rank: step times, step peaks and memory figures of each variant."""
    torch.set_num_threads(1)
    regime = REGIMES["large"]
    spec = build_model("llama", "tiny", seed=0, **dict(regime.overrides))
    kinds = [k.value for k in spec.block_kinds]
    partition = list(stage_partition(kinds, 2))
    inputs, targets = spec.make_batch(regime.microbatch_size * N_MB, 0)
    pipes = {
        name: Pipeline(
            copy.deepcopy(spec.blocks),
            spec.loss_fn,
            "1f1b",
            N_MB,
            partition=partition,
            device="cpu",
            **options,
        )
        for name, options in VARIANTS.items()
    }
    times, peaks = alternate(pipes, inputs, targets)
    memory = {name: pipe.memory_stats() for name, pipe in pipes.items()}
    bubbles = {name: bubble_ratio(pipe.local_spans) for name, pipe in pipes.items()}
    for pipe in pipes.values():
        pipe.close()
    return {
        "step_s": {n: statistics.median(t) for n, t in times.items()},
        "peak": peaks,
        "memory": memory,
        "local_bubble": bubbles,
        "partition": partition,
    }


def _limit_of_half(pipe: Pipeline) -> tuple[float, float]:
    """The simulated peak of ``pipe``'s plan, and that peak less half the stashes its
    fullest rank holds at it (each stage's stash of one micro-batch times half of them)."""
    from twobp.sim import simulate

    assert pipe.plan is not None
    costs, schedule = pipe.plan.costs, pipe.plan.schedule
    assert costs.weight_grad_bytes is not None
    peaks = simulate(schedule, costs).peak_memory
    limits = [
        peak - N_MB / 2 * sum(costs.weight_grad_bytes[s] for s in schedule.stages_of(rank))
        for rank, peak in enumerate(peaks)
    ]
    return max(peaks), max(limits)


def auto_at_half() -> dict[str, Any]:
    """On every rank: step times and peaks of recompute="auto" at a limit of half the stashes."""
    from twobp.schedule.rebuild import rebuilt_microbatches

    torch.set_num_threads(1)
    regime = REGIMES["large"]
    spec = build_model("llama", "tiny", seed=0, **dict(regime.overrides))
    kinds = [k.value for k in spec.block_kinds]
    partition = list(stage_partition(kinds, 2))
    inputs, targets = spec.make_batch(regime.microbatch_size * N_MB, 0)
    example = spec.make_batch(regime.microbatch_size, 0)[0]
    profiled = Pipeline(
        copy.deepcopy(spec.blocks),
        spec.loss_fn,
        "1f1b",
        N_MB,
        partition=partition,
        two_bp=True,
        costs="profile",
        example_input=example,
        device="cpu",
    )
    peak, limit = _limit_of_half(profiled)
    costs = profiled.plan.costs if profiled.plan is not None else None
    profiled.close()
    fixed = {"partition": partition, "costs": costs, "two_bp": True}
    variants: dict[str, tuple[str, dict[str, Any]]] = {
        "1f1b+2bp (no recomputation)": ("1f1b", fixed),
        "1f1b+2bp, recompute='derivatives'": ("1f1b", {**fixed, "recompute": "derivatives"}),
        "1f1b+2bp, recompute='auto'": (
            "1f1b",
            {**fixed, "recompute": "auto", "memory_limit": limit},
        ),
        "schedule='auto', recompute='auto'": (
            "auto",
            {
                "recompute": "auto",
                "memory_limit": limit,
                "example_input": example,
                "auto_trials": 0,
            },
        ),
    }
    pipes = {
        name: Pipeline(copy.deepcopy(spec.blocks), spec.loss_fn, schedule, N_MB, device="cpu", **o)
        for name, (schedule, o) in variants.items()
    }
    times, peaks = alternate(pipes, inputs, targets)
    out = {
        "step_s": {n: statistics.median(t) for n, t in times.items()},
        "peak": peaks,
        "stash": {name: pipe.memory_stats()["stash"] for name, pipe in pipes.items()},
        "rebuilt": {name: rebuilt_microbatches(pipe.schedule) for name, pipe in pipes.items()},
        "ran": {name: str(pipe.schedule).splitlines()[0] for name, pipe in pipes.items()},
        "simulated_peak": peak,
        "limit": limit,
        "partition": partition,
    }
    for pipe in pipes.values():
        pipe.close()
    return out


def print_auto_at_half() -> None:
    results = launch(auto_at_half, 2, threads_per_rank=1, timeout=1800)
    lead = results[0]
    print(
        f"\n3. recompute='auto', large regime, partition {lead['partition']}, m = {N_MB}, "
        f"{ROUNDS} timed rounds; memory_limit {_mib(lead['limit'])} MiB (the simulated peak "
        f"{_mib(lead['simulated_peak'])} MiB less half the stashes)"
    )
    base = lead["step_s"]["1f1b+2bp (no recomputation)"]
    derivatives = lead["step_s"]["1f1b+2bp, recompute='derivatives'"]
    print(
        "| variant | ran | rebuilt (stage: micro-batches) | step s | vs no recomputation | "
        "vs derivatives | step peak MiB (max rank) | stash MiB (max rank) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, step in lead["step_s"].items():
        peak = max(r["peak"][name] for r in results)
        stash = max(r["stash"][name] for r in results)
        rebuilt = "; ".join(f"{s}: {list(m)}" for s, m in lead["rebuilt"][name].items()) or "-"
        print(
            f"| {name} | {lead['ran'][name]} | {rebuilt} | {step:.3f} | {base / step:.3f} | "
            f"{derivatives / step:.3f} | {_mib(peak)} | {_mib(stash)} |"
        )


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    print(f"torch {torch.__version__}, {sys.platform}; 2 ranks x 1 thread, gloo, CPU")
    if sys.argv[1:] == ["auto"]:
        print_auto_at_half()
        return
    per_rank = launch(mlp_memory, 2, threads_per_rank=1, timeout=600)
    print("\n1. MLP (8 blocks of 256 -> 1024 -> 256 and a head), 1f1b + 2BP (paper), m = 8")
    print("| recompute | rank | activations MiB | stash MiB | peak MiB | activations x | stash x |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in MODES:
        for rank, figures in enumerate(per_rank):
            plain, f = figures["None"], figures[str(mode)]
            print(
                f"| {mode} | {rank} | {_mib(f['activations'])} | {_mib(f['stash'])} | "
                f"{_mib(f['peak'])} | {f['activations'] / plain['activations']:.3f} | "
                f"{f['stash'] / plain['stash']:.3f} |"
            )
    results = launch(large_regime, 2, threads_per_rank=1, timeout=1800)
    lead = results[0]
    print(f"\n2. twobp bench's large regime, partition {lead['partition']}, m = {N_MB}, "
          f"{ROUNDS} timed rounds")  # fmt: skip
    base = lead["step_s"]["1f1b+2bp"]
    plain_peak = max(r["peak"]["1f1b"] for r in results)
    print(
        "| variant | step s | throughput vs 1f1b+2bp | step peak MiB (max rank) | "
        "peak vs plain 1f1b | stash MiB (max rank) | bubble rank 0 / 1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in VARIANTS:
        step = lead["step_s"][name]
        peak = max(r["peak"][name] for r in results)
        stash = max(r["memory"][name]["stash"] for r in results)
        bubbles = " / ".join(f"{r['local_bubble'][name]:.3f}" for r in results)
        print(
            f"| {name} | {step:.3f} | {base / step:.3f} | {_mib(peak)} | "
            f"{peak / plain_peak:.2f} | {_mib(stash)} | {bubbles} |"
        )
    print_auto_at_half()


if __name__ == "__main__":
    main()
