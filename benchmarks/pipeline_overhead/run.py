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

and single-process references, run by every rank at the same time on its own
core (the bench's references, divided by ``p`` they bound the pipeline):

  whole     F and B of the whole batch at once
  micro     F and B of each micro-batch in turn
  limit     F and I per micro-batch, then one W over all (the 2BP limit)

Regimes (LLaMA-like, vocabulary 256, 4 decoder blocks, as ``twobp bench``):

  large     dim 256, 4 sequences x 64 tokens per micro-batch
  small     dim 512, 2 sequences x 16 tokens per micro-batch

For every variant it prints the median step time, the ratio to ``fused``,
the efficiency against ``whole / p`` and ``limit / p``, the measured bubble
of each rank (idle share of the step from ``pipe.timeline()``) and the
median compute time of each action kind per rank::

    .venv/bin/python benchmarks/pipeline_overhead/run.py --regimes large,small \\
        --microbatches 2,4,8 --steps 10

``--profile VARIANT`` runs the timed steps of that variant under cProfile on
every rank and writes ``rank<r>.prof`` files into ``--profile-dir``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.engine import defer_weight_grads
from twobp.models import build_model
from twobp.models.spec import ModelSpec
from twobp.runtime import Pipeline, launch
from twobp.runtime.microbatch import split_batch
from twobp.runtime.resolve import resolve_schedule
from twobp.timeline import Span, bubble_ratio, busy_time, makespan

REGIMES: dict[str, tuple[dict[str, int], int]] = {
    "large": (dict(dim=256, n_layers=4, n_heads=8, ffn_dim=688, seq_len=64), 4),
    "small": (dict(dim=512, n_layers=4, n_heads=8, ffn_dim=1376, seq_len=16), 2),
}
"""Model overrides and sequences per micro-batch of each regime."""


@dataclass
class Variant:
    """One thing measured: a pipeline or a single-process reference."""

    name: str
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    pipe: Pipeline | None = None
    seconds: list[float] = field(default_factory=list)
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
    name: str, spec: ModelSpec, schedule: str, m: int, policy: str | None, args: Any
) -> Variant:
    # A partition like the bench's: embedding with the first stage, head with the last.
    two_bp = policy is not None
    resolved = resolve_schedule(
        schedule, n_ranks=2, n_microbatches=m, two_bp=two_bp, policy=policy or "paper"
    )
    pipe = Pipeline(
        copy.deepcopy(spec.blocks),
        spec.loss_fn,
        schedule=resolved,
        two_bp=two_bp,
        num_threads=args.threads,
        partition=stage_partition(len(spec.blocks), resolved.n_stages),
    )
    n_stages = resolved.n_stages
    inputs, targets = spec.make_batch(args.seqs * m, 0)
    first, last = 0 in pipe.stages, n_stages - 1 in pipe.stages
    x = inputs if first else None
    y = targets if last else None
    return Variant(name, lambda: pipe.step(x, y) and None, pipe.zero_grad, pipe)


def reference_variant(name: str, spec: ModelSpec, m: int, args: Any) -> Variant:
    model = nn.Sequential(*copy.deepcopy(spec.blocks))
    inputs, targets = spec.make_batch(args.seqs * m, 0)
    xs, ys = split_batch(inputs, m), split_batch(targets, m, "targets")
    loss_fn, scale = spec.loss_fn, 1.0 / m
    if name == "whole":

        def step() -> None:
            loss_fn(model(inputs), targets).backward()

    elif name == "micro":

        def step() -> None:
            for x, y in zip(xs, ys, strict=True):
                (loss_fn(model(x), y) * scale).backward()

    else:
        store = defer_weight_grads(model)

        def step() -> None:
            for mb, (x, y) in enumerate(zip(xs, ys, strict=True)):
                with store.forward(mb):
                    loss = loss_fn(model(x), y) * scale
                store.backward_input(mb, [loss], [None], [])
            store.backward_weight(range(m))
            store.finish_step()

    return Variant(name, step, lambda: model.zero_grad(set_to_none=True))


def kind_times(spans: Sequence[Span]) -> dict[tuple[int, str], float]:
    """Total compute seconds per (rank, action kind letter)."""
    out: dict[tuple[int, str], float] = {}
    for s in spans:
        key = (s.rank, s.action.kind.value)
        out[key] = out.get(key, 0.0) + s.duration
    return out


def measure(args: Any) -> list[dict[str, Any]]:
    """Body of each rank: every regime and micro-batch count, variants in turn."""
    torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    results = []
    for regime in args.regimes:
        overrides, seqs = REGIMES[regime]
        args.seqs = seqs
        spec = build_model("llama", "tiny", vocab_size=256, **overrides)
        for m in args.microbatches:
            variants = [
                pipeline_variant("fused", spec, args.schedule, m, None, args),
                pipeline_variant("paper", spec, args.schedule, m, "paper", args),
                pipeline_variant("eager", spec, args.schedule, m, "eager", args),
            ]
            for extra in args.extra:
                schedule, _, policy = extra.partition(":")
                chosen = None if policy == "none" else (policy or "paper")
                variants.append(pipeline_variant(extra, spec, schedule, m, chosen, args))
            if not args.no_references:
                variants += [
                    reference_variant(n, spec, m, args) for n in ("whole", "micro", "limit")
                ]
            profiler = cProfile.Profile() if args.profile else None
            for step in range(args.warmup + args.steps):
                for v in variants:
                    profile = profiler is not None and v.name == args.profile
                    dist.barrier()
                    start = time.perf_counter()
                    if profile and step >= args.warmup:
                        profiler.enable()  # type: ignore[union-attr]
                    v.step()
                    if profile and step >= args.warmup:
                        profiler.disable()  # type: ignore[union-attr]
                    if v.pipe is not None:
                        dist.barrier()
                    elapsed = time.perf_counter() - start
                    if v.pipe is not None:
                        spans = v.pipe.timeline()
                    v.zero_grad()
                    if step < args.warmup:
                        continue
                    v.seconds.append(elapsed)
                    if v.pipe is not None:
                        ranks = sorted({s.rank for s in spans})
                        v.bubbles.append([bubble_ratio(spans, r) for r in ranks])
                        v.kinds.append(kind_times(spans))
                        if args.verbose and rank == 0:
                            total = makespan(spans)
                            print(
                                f"{regime} m={m} {v.name}: {elapsed * 1e3:.1f} ms, makespan "
                                f"{total * 1e3:.1f}, busy "
                                + ", ".join(f"{busy_time(spans, r) * 1e3:.1f}" for r in ranks),
                                flush=True,
                            )
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


def report(results: list[dict[str, Any]], p: int) -> None:
    """Print one table per regime and micro-batch count (from rank 0's figures)."""
    for r in results:
        vs = r["variants"]
        med = {name: statistics.median(v["seconds"]) for name, v in vs.items()}
        print(f"\n## {r['regime']}, m = {r['m']}  (median of {len(vs['fused']['seconds'])} steps)")
        bounds = {k: med[k] / p for k in ("whole", "limit") if k in med}
        head = "| variant | step ms | fused/x | eff whole/p | eff limit/p | bubble r0 | bubble r1 |"
        print(head + " compute ms per rank (kind: r0/r1) |")
        print("|---" * 8 + "|")
        for name, v in vs.items():
            eff = [
                f"{bounds[k] / med[name]:.3f}" if k in bounds else "" for k in ("whole", "limit")
            ]
            ratio = med["fused"] / med[name]
            bubbles = ["", ""]
            kinds = ""
            if v["bubbles"]:
                per_rank = list(zip(*v["bubbles"], strict=True))
                bubbles = [f"{statistics.median(b):.1%}" for b in per_rank[:2]]
                letters = sorted({k for step in v["kinds"] for _, k in step})
                parts = []
                for letter in letters:
                    times = [
                        statistics.median(step.get((rk, letter), 0.0) for step in v["kinds"]) * 1e3
                        for rk in range(p)
                    ]
                    parts.append(f"{letter}: " + "/".join(f"{t:.1f}" for t in times))
                kinds = ", ".join(parts)
            print(
                f"| {name} | {med[name] * 1e3:.1f} | {ratio:.3f} | {eff[0]} | {eff[1]} "
                f"| {bubbles[0]} | {bubbles[1]} | {kinds} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--regimes", type=lambda s: s.split(","), default=["large", "small"])
    parser.add_argument(
        "--microbatches", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8]
    )
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument(
        "--extra",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="more twobp variants, schedule:policy (policy none: without 2BP)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-references", action="store_true")
    parser.add_argument("--profile", default="", help="variant to run under cProfile")
    parser.add_argument("--profile-dir", default="/tmp/pipeline_overhead")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    results = launch(measure, 2, args, threads_per_rank=args.threads)[0]
    print(
        f"2 ranks x {args.threads} thread(s), schedule {args.schedule}, "
        f"{args.steps} timed steps after {args.warmup}, variants in turn"
    )
    report(results, 2)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
