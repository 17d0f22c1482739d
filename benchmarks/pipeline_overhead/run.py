"""Where a 2-rank pipeline loses time against its bound, with and without 2BP.

Launches 2 ranks (1 thread each by default) and, for each regime and
micro-batch count, builds every variant on the same model, data and
partition, then runs them step by step in turn (A B C A B C ...), so that a
machine shared with other work slows them alike. Compare ratios from one run,
never absolute times across runs.

Variants:

  fused     1f1b (or --schedule) without 2BP: fused B
  paper     the same with 2BP, W placed by the paper policy
  eager     the same with 2BP, each W right after its I
  <s>:<p>   any other twobp schedule ``s`` with 2BP policy ``p`` (``--extra``;
            ``<s>:none`` runs it without 2BP)
  torch:<S> a ``torch.distributed.pipelining`` schedule ``Schedule<S>`` (``--torch``)

and single-process references, run by every rank at the same time on its own
core (the bench's references; divided by ``p`` they bound the pipeline):

  whole     F and B of the whole batch at once
  micro     F and B of each micro-batch in turn
  limit     F and I per micro-batch, then one W over all (the 2BP limit)

Regimes (LLaMA-like, vocabulary 256, 4 decoder blocks, as ``twobp bench``):

  large     dim 256, 4 sequences x 64 tokens per micro-batch
  small     dim 512, 2 sequences x 16 tokens per micro-batch

For every variant it prints the median step time, ``fused / variant`` (the
median of the per-round ratios, robust to slow rounds), the efficiency
against ``whole / p`` and ``limit / p``, the measured bubble of each rank
(idle share of the step, from ``pipe.timeline()``), the CPU seconds each rank
spent in the step (all its threads: when it is well below the step time
times the ranks, other work on the machine took the cores) and the median
compute time of each action kind per rank::

    .venv/bin/python benchmarks/pipeline_overhead/run.py --regimes large,small \\
        --microbatches 2,4,8 --steps 10

``--baseline REV`` also runs fused, paper and eager on the twobp of git
revision ``REV`` (as ``before:fused`` ...), in the same rounds: a before/after
comparison that the machine's load cannot skew. ``--profile VARIANT`` runs the
timed steps of that variant under cProfile on every rank and writes
``<regime>-m<m>-rank<r>.prof`` into ``--profile-dir``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.engine import defer_weight_grads
from twobp.models import ModelSpec, build_model
from twobp.runtime import launch
from twobp.runtime.microbatch import split_batch
from twobp.runtime.resolve import resolve_schedule
from twobp.timeline import Span, bubble_ratio

REGIMES: dict[str, tuple[dict[str, int], int]] = {
    "large": ({"dim": 256, "n_layers": 4, "n_heads": 8, "ffn_dim": 688, "seq_len": 64}, 4),
    "small": ({"dim": 512, "n_layers": 4, "n_heads": 8, "ffn_dim": 1376, "seq_len": 16}, 2),
}
"""Model overrides and sequences per micro-batch of each regime."""

N_RANKS = 2


@dataclass
class Variant:
    """One thing measured: a pipeline or a single-process reference."""

    name: str
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    pipe: Any = None
    collective: bool = True
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    bubbles: list[list[float]] = field(default_factory=list)
    kinds: list[dict[tuple[int, str], float]] = field(default_factory=list)


def stage_partition(n_blocks: int, n_stages: int) -> list[int]:
    """Decoder blocks split evenly; the embedding joins stage 0, the head the last stage."""
    body = n_blocks - 2
    counts = [body // n_stages + (1 if s < body % n_stages else 0) for s in range(n_stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def pipeline_variant(
    name: str,
    spec: ModelSpec,
    schedule: str,
    m: int,
    policy: str | None,
    args: Any,
    package: str = "twobp",
) -> Variant:
    """A twobp pipeline (of ``package``: this twobp or the baseline), partitioned as the bench."""
    two_bp = policy is not None
    resolved = resolve_schedule(
        schedule, n_ranks=N_RANKS, n_microbatches=m, two_bp=two_bp, policy=policy or "paper"
    )
    pipeline_class = importlib.import_module(f"{package}.runtime").Pipeline
    pipe = pipeline_class(
        copy.deepcopy(spec.blocks),
        spec.loss_fn,
        schedule=schedule,
        n_microbatches=m,
        two_bp=two_bp,
        two_bp_policy=policy or "paper",
        num_threads=args.threads,
        partition=stage_partition(len(spec.blocks), resolved.n_stages),
    )
    inputs, targets = spec.make_batch(args.seqs * m, 0)
    x = inputs if 0 in pipe.stages else None
    y = targets if resolved.n_stages - 1 in pipe.stages else None

    def step() -> None:
        pipe.step(x, y)

    return Variant(name, step, pipe.zero_grad, pipe)


def torch_variant(name: str, spec: ModelSpec, m: int, args: Any) -> Variant:
    """A ``torch.distributed.pipelining`` schedule, as the bench runs it."""
    from twobp_bench.matrix import TORCH, placement
    from twobp_bench.matrix import Variant as BenchVariant
    from twobp_bench.torch_pipelining import TorchRunner

    variant = BenchVariant(TORCH, name.split(":", 1)[1])
    n_stages = len(placement(variant, N_RANKS))
    inputs, targets = spec.make_batch(args.seqs * m, 0)
    runner = TorchRunner(
        variant,
        copy.deepcopy(spec.blocks),
        spec.loss_fn,
        m,
        stage_partition(len(spec.blocks), n_stages),
        inputs,
        targets,
        rank=dist.get_rank(),
        n_ranks=N_RANKS,
        device=torch.device("cpu"),
    )
    return Variant(name, runner.step, runner.zero_grad)


def reference_variant(name: str, spec: ModelSpec, m: int, args: Any) -> Variant:
    """A single-process reference on this rank alone."""
    model = nn.Sequential(*copy.deepcopy(spec.blocks))
    inputs, targets = spec.make_batch(args.seqs * m, 0)
    xs, ys = split_batch(inputs, m), list(torch.chunk(targets, m))
    loss_fn, scale = spec.loss_fn, 1.0 / m
    store = defer_weight_grads(model) if name == "limit" else None

    def step() -> None:
        if name == "whole":
            torch.autograd.backward([loss_fn(model(inputs), targets)])
        elif store is None:
            for x, y in zip(xs, ys, strict=True):
                torch.autograd.backward([loss_fn(model(x), y) * scale])
        else:
            for mb, (x, y) in enumerate(zip(xs, ys, strict=True)):
                with store.forward(mb):
                    loss = loss_fn(model(x), y) * scale
                store.backward_input(mb, [loss], [None], [])
            store.backward_weight(range(m))
            store.finish_step()

    return Variant(name, step, lambda: model.zero_grad(set_to_none=True), collective=False)


def kind_times(spans: Sequence[Span]) -> dict[tuple[int, str], float]:
    """Total compute seconds per (rank, action kind letter)."""
    out: dict[tuple[int, str], float] = {}
    for s in spans:
        key = (s.rank, s.action.kind.value)
        out[key] = out.get(key, 0.0) + s.duration
    return out


def build_variants(spec: ModelSpec, m: int, args: Any) -> list[Variant]:
    packages = [("", "twobp")]
    if args.baseline:
        packages.append(("before:", BASELINE_PACKAGE))
    variants = [
        pipeline_variant(prefix + name, spec, args.schedule, m, policy, args, package)
        for prefix, package in packages
        for name, policy in (("fused", None), ("paper", "paper"), ("eager", "eager"))
    ]
    for extra in args.extra:
        schedule, _, policy = extra.partition(":")
        chosen = None if policy == "none" else (policy or "paper")
        variants.append(pipeline_variant(extra, spec, schedule, m, chosen, args))
    variants += [torch_variant(f"torch:{name}", spec, m, args) for name in args.torch]
    if not args.no_references:
        variants += [reference_variant(n, spec, m, args) for n in ("whole", "micro", "limit")]
    return variants


def run_step(v: Variant, profiler: cProfile.Profile | None) -> tuple[float, float]:
    """One step of ``v``: wall seconds (to the last rank's end) and this rank's CPU seconds."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    v.step()
    if profiler is not None:
        profiler.disable()
    cpu = time.process_time() - cpu
    if v.collective:
        dist.barrier()
    return time.perf_counter() - start, cpu


BASELINE_PACKAGE = "twobp_baseline"
"""The name the baseline revision's twobp is imported under."""


def export_baseline(revision: str) -> str:
    """Copy twobp of git ``revision`` into a temporary folder as :data:`BASELINE_PACKAGE`.

    Returns:
        The folder to put on ``sys.path``.
    """
    folder = Path(tempfile.mkdtemp(prefix="twobp-baseline-"))
    root = Path(__file__).resolve().parents[2]
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", revision, "src/twobp"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    package = folder / BASELINE_PACKAGE
    shutil.move(str(folder / "src" / "twobp"), package)
    pattern = re.compile(r"\btwobp(?=[. ])")
    for path in package.rglob("*.py"):
        path.write_text(pattern.sub(BASELINE_PACKAGE, path.read_text()))
    return str(folder)


def measure(args: Any) -> list[dict[str, Any]]:
    """Body of each rank: every regime and micro-batch count, variants in turn."""
    torch.set_num_threads(args.threads)
    if args.baseline_path:
        sys.path.insert(0, args.baseline_path)
    rank = dist.get_rank()
    results = []
    for regime in args.regimes:
        overrides, args.seqs = REGIMES[regime]
        spec = build_model("llama", "tiny", vocab_size=256, **overrides)  # type: ignore[arg-type]
        for m in args.microbatches:
            variants = build_variants(spec, m, args)
            profiler = cProfile.Profile() if args.profile else None
            for step in range(args.warmup + args.steps):
                timed = step >= args.warmup
                # Each round starts with the next variant: no variant is always first.
                shift = step % len(variants)
                for v in variants[shift:] + variants[:shift]:
                    profiling = timed and v.name == args.profile
                    seconds, cpu = run_step(v, profiler if profiling else None)
                    spans = v.pipe.timeline() if v.pipe is not None else []
                    v.zero_grad()
                    if not timed:
                        continue
                    v.seconds.append(seconds)
                    v.cpu.append(cpu)
                    if spans:
                        v.bubbles.append([bubble_ratio(spans, r) for r in range(N_RANKS)])
                        v.kinds.append(kind_times(spans))
            if profiler is not None:
                Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
                profiler.dump_stats(f"{args.profile_dir}/{regime}-m{m}-rank{rank}.prof")
            results.append(
                {
                    "regime": regime,
                    "m": m,
                    "variants": {
                        v.name: {
                            "seconds": v.seconds,
                            "cpu": v.cpu,
                            "bubbles": v.bubbles,
                            "kinds": v.kinds,
                            "schedule": v.pipe.schedule.name if v.pipe is not None else v.name,
                        }
                        for v in variants
                    },
                }
            )
            del variants
    return results


def paired_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """Median over rounds of ``base / other``: round by round, as the load was alike."""
    return statistics.median(a / b for a, b in zip(base, other, strict=True))


def report(per_rank: list[list[dict[str, Any]]]) -> None:
    """One table per regime and micro-batch count."""
    for index, r in enumerate(per_rank[0]):
        vs = r["variants"]
        cpu = {
            name: [per_rank[k][index]["variants"][name]["cpu"] for k in range(N_RANKS)]
            for name in vs
        }
        med = {name: statistics.median(v["seconds"]) for name, v in vs.items()}
        rounds = len(vs["fused"]["seconds"])
        print(f"\n## {r['regime']}, m = {r['m']}  (medians of {rounds} rounds)\n")
        bounds = {k: med[k] / N_RANKS for k in ("whole", "limit") if k in med}
        bases = [b for b in ("fused", "before:fused") if b in vs]
        print(
            "| variant | step ms | "
            + " | ".join(f"{b}/x" for b in bases)
            + " | eff whole/p | eff limit/p | bubble r0 / r1 "
            "| CPU ms r0 / r1 | compute ms per kind, r0 / r1 |"
        )
        print("|---" * (7 + len(bases)) + "|")
        for name, v in vs.items():
            eff = [f"{bounds[k] / med[name]:.3f}" if k in bounds else "" for k in bounds]
            eff += [""] * (2 - len(eff))
            ratios = " | ".join(
                f"{paired_ratio(vs[b]['seconds'], v['seconds']):.3f}" for b in bases
            )
            cpus = " / ".join(f"{statistics.median(c) * 1e3:.0f}" for c in cpu[name])
            bubbles = kinds = ""
            if v["bubbles"]:
                per_rank_bubble = list(zip(*v["bubbles"], strict=True))
                bubbles = " / ".join(f"{statistics.median(b):.1%}" for b in per_rank_bubble)
                letters = sorted({k for step in v["kinds"] for _, k in step})
                parts = []
                for letter in letters:
                    times = [
                        statistics.median(step.get((rk, letter), 0.0) for step in v["kinds"])
                        for rk in range(N_RANKS)
                    ]
                    parts.append(f"{letter} {' / '.join(f'{t * 1e3:.0f}' for t in times)}")
                kinds = ", ".join(parts)
            label = name if v["schedule"] == name else f"{name} ({v['schedule']})"
            print(
                f"| {label} | {med[name] * 1e3:.1f} | {ratios} | {eff[0]} | {eff[1]} "
                f"| {bubbles} | {cpus} | {kinds} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--regimes", type=lambda s: s.split(","), default=["large", "small"])
    parser.add_argument(
        "--microbatches", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8]
    )
    parser.add_argument("--schedule", default="1f1b", help="twobp schedule of fused/paper/eager")
    parser.add_argument(
        "--extra",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="more twobp variants, schedule:policy (policy none: without 2BP)",
    )
    parser.add_argument(
        "--torch",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="torch.distributed.pipelining schedules, e.g. 1F1B,ZBVZeroBubble",
    )
    parser.add_argument(
        "--baseline", default="", help="git revision whose twobp also runs fused/paper/eager"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--no-references", action="store_true")
    parser.add_argument("--profile", default="", help="variant to run under cProfile")
    parser.add_argument("--profile-dir", default="/tmp/pipeline_overhead")
    args = parser.parse_args()
    started = time.perf_counter()
    args.baseline_path = export_baseline(args.baseline) if args.baseline else ""
    try:
        per_rank = launch(measure, N_RANKS, args, threads_per_rank=args.threads)
    finally:
        if args.baseline_path:
            shutil.rmtree(args.baseline_path, ignore_errors=True)
    baseline = f", before: twobp of {args.baseline}" if args.baseline else ""
    print(
        f"{N_RANKS} ranks x {args.threads} thread(s), schedule {args.schedule}, "
        f"{args.steps} timed rounds after {args.warmup}, variants in turn{baseline}"
    )
    report(per_rank)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
