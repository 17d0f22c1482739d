"""The ``dynamic`` 2BP policy against the static ones when the costs move at run time.

Two local ranks (gloo, one thread each, each pinned to its own core) run the
small LLaMA-like model (8 layers, width 256; 128 tokens) with 2BP. For each
schedule (1f1b with m = p and m = 4p, zb-h1, zb-v), one pipeline per policy on
the same blocks takes turns step by step (each claims the blocks for its step),
in rounds after a warm-up, under four conditions:

  as is       nothing disturbs the steps
  slow stage  on a random third of the rounds, every block of one rank (drawn
              at random) computes 25% longer (its forward spins three quarters
              of its own time, as much as a quarter of F + I + W)
  seq-len     each round draws its sequence length from 16..128 tokens
  busy core   a process pinned to rank 1's core computes for 20 ms and rests for
              20 ms, over and over
  slow micro-batches  the last rank's blocks compute 25% longer on a random third
              of the micro-batches (drawn per forward, the same for every policy)

Every pipeline of a round meets the same disturbance. Printed per schedule and
condition: each policy's median step, dynamic against the best static policy
(the ratio of medians and the median of the paired per-round ratios), each
rank's bubble (the part of the step not computing) and how long it waited on a
receive while it held ``W`` whose ``I`` had run (W that could have filled the
wait), and how many ``W`` parts ran in waits. On ``zb-*`` the static policies
keep the schedule's own ``W`` placement: one static variant. Each pipeline plans on the
same first batch (a V balances its stages there).

    PYTHONPATH=src .venv/bin/python benchmarks/dynamic_weights/run.py [--rounds 15]
        [--cases 1f1b:2,zb-v:4] [--conditions "as is,seq-len"]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import Tensor, nn

from twobp.models import build_model
from twobp.runtime import Pipeline, launch

CONDITIONS = ("as is", "slow stage", "seq-len", "busy core", "slow micro-batches")
CASES = (("1f1b", 2), ("1f1b", 8), ("zb-h1", 4), ("zb-v", 4))
POLICIES = ("eager", "paper", "fill", "dynamic")
SEQ = 128
ROWS_PER_MICROBATCH = 2

_SLOW: dict[str, Any] = {"rank": -1, "round": None, "calls": 0, "blocks": 1}
"""The rank whose blocks run slower in this step (-1: none); with ``round`` set, only
on a third of its micro-batches, drawn from the round and the micro-batch's place in
the rank's forwards (``calls`` block forwards so far, ``blocks`` per micro-batch): the
same micro-batches for every policy."""


class Slowable(nn.Module):
    """A block whose forward, on the rank :data:`_SLOW` names, spins 3/4 of its time more."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self.inner(*args)
        if _SLOW["rank"] == torch.distributed.get_rank() and _picked():
            until = time.perf_counter() + 0.75 * (time.perf_counter() - start)
            while time.perf_counter() < until:
                pass
        return out


def _picked() -> bool:
    """Whether this forward's micro-batch is slowed (always, without a round)."""
    if _SLOW["round"] is None:
        return True
    microbatch = _SLOW["calls"] // _SLOW["blocks"]
    _SLOW["calls"] += 1
    return random.Random(f"{_SLOW['round']}:{microbatch}").random() < 1 / 3


_BUSY = """
import os, time
os.sched_setaffinity(0, {%d})
while True:
    until = time.perf_counter() + 0.02
    while time.perf_counter() < until:
        pass
    time.sleep(0.02)
"""


def _busy(core: int) -> subprocess.Popen[bytes]:
    """A process that computes for 20 ms and rests for 20 ms on ``core``, until killed."""
    return subprocess.Popen([sys.executable, "-c", _BUSY % core])


def _batch(seed: int, rows: int, seq: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, seq + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _pipelines(blocks: list[nn.Module], loss_fn: Any, schedule: str, m: int) -> dict[str, Any]:
    policies = POLICIES if schedule == "1f1b" else ("paper", "dynamic")
    inputs, _ = _batch(0, m * ROWS_PER_MICROBATCH, SEQ)
    pipes: dict[str, Pipeline] = {}
    for policy in policies:
        for other in pipes.values():
            other.release_blocks()
        pipes[policy] = Pipeline(
            blocks, loss_fn, schedule=schedule, n_microbatches=m, two_bp_policy=policy
        )
        # A V balances its stages on a first batch: the same one for every policy.
        pipes[policy].plan_on(inputs)
    for pipe in pipes.values():
        pipe.release_blocks()
    return pipes


def measure(args: dict[str, Any]) -> dict[str, Any]:
    """On every rank: per case, condition and policy, the step times by round and the
    step-time counts summed over the rounds."""
    rank = torch.distributed.get_rank()
    os.sched_setaffinity(0, {args["cores"][rank]})
    spec = build_model("llama", "small", seed=0, seq_len=SEQ, vocab_size=256)
    blocks: list[nn.Module] = [Slowable(b) for b in spec.blocks]
    out: dict[str, Any] = {}
    for schedule, m in args["cases"]:
        pipes = _pipelines(blocks, spec.loss_fn, schedule, m)
        for condition in args["conditions"]:
            draw = random.Random(f"{schedule}{m}{condition}")
            times: dict[str, list[float]] = {p: [] for p in pipes}
            counts: dict[str, list[dict[str, float]]] = {p: [] for p in pipes}
            busy = _busy(args["cores"][1]) if condition == "busy core" and rank == 1 else None
            for round_ in range(args["warmup"] + args["rounds"]):
                slow = draw.random() < 1 / 3 and condition == "slow stage"
                slow_rank = draw.randrange(2)
                seq = draw.randint(16, SEQ) if condition == "seq-len" else SEQ
                inputs, targets = _batch(round_, m * ROWS_PER_MICROBATCH, seq)
                for policy, pipe in pipes.items():
                    _SLOW.update(rank=slow_rank if slow else -1, round=None, calls=0)
                    if condition == "slow micro-batches":
                        # The last stage's rank on 1f1b and zb-h1; on zb-v, rank 0.
                        _SLOW.update(rank=0 if schedule == "zb-v" else 1, round=round_)
                        _SLOW["blocks"] = sum(
                            isinstance(m, Slowable) for m in pipe.module.modules()
                        )
                    pipe.claim_blocks()
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    pipe.step(inputs, targets)
                    seconds = time.perf_counter() - start
                    pipe.zero_grad()
                    pipe.release_blocks()
                    if round_ >= args["warmup"]:
                        times[policy].append(seconds)
                        counts[policy].append(vars(pipe.step_times).copy())
            if busy is not None:
                busy.kill()
                busy.wait()
            out[f"{schedule} m={m}|{condition}"] = {"times": times, "counts": counts}
        for pipe in pipes.values():
            pipe.close()
    return out


def _line(label: str, per_rank: list[dict[str, Any]], steps: list[float]) -> str:
    """Bubble and W-queued wait per rank, and W parts in waits, of one policy."""
    cells = []
    for rank, counts in enumerate(per_rank):
        step = statistics.median(steps)
        compute = statistics.median(c["compute"] for c in counts)
        queued = statistics.median(c["waited_with_weights_queued"] for c in counts)
        parts = statistics.median(c["weights_in_waits"] for c in counts)
        cells.append(
            f"r{rank} bubble {100 * max(0.0, 1 - compute / step):4.1f}% "
            f"W-queued wait {1e3 * queued:5.1f} ms, {parts:3.0f} W parts in waits"
        )
    return f"    {label:8s} " + " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds measured per condition")
    parser.add_argument("--warmup", type=int, default=2, help="rounds not measured")
    parser.add_argument(
        "--cases",
        default=",".join(f"{s}:{m}" for s, m in CASES),
        help="schedule:micro-batches pairs, comma-separated (default: all four)",
    )
    parser.add_argument(
        "--conditions",
        default=",".join(CONDITIONS),
        help=f"conditions, comma-separated, of: {', '.join(CONDITIONS)} (default: all)",
    )
    args = vars(parser.parse_args())
    args["cases"] = [(c.split(":")[0], int(c.split(":")[1])) for c in args["cases"].split(",")]
    args["conditions"] = args["conditions"].split(",")
    unknown = sorted(set(args["conditions"]) - set(CONDITIONS))
    if unknown:
        raise SystemExit(f"unknown conditions {unknown}: choose among {', '.join(CONDITIONS)}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores: one per rank")
    args["cores"] = cores[:2]
    results = launch(measure, 2, args, threads_per_rank=1, timeout=3600)
    print(
        f"llama small (8 layers, width 256), 2 ranks x 1 thread, gloo, {SEQ} tokens, "
        f"{ROWS_PER_MICROBATCH} rows per micro-batch, {args['rounds']} rounds after "
        f"{args['warmup']} (policies alternated within each round)"
    )
    worst: dict[str, float] = {}
    for key in results[0]:
        case, condition = key.split("|")
        # The slowest rank's time is the step's.
        times = {
            p: [max(r[key]["times"][p][i] for r in results) for i in range(args["rounds"])]
            for p in results[0][key]["times"]
        }
        static = {p: t for p, t in times.items() if p != "dynamic"}
        best = min(static, key=lambda p: statistics.median(static[p]))
        paired = [d / s for d, s in zip(times["dynamic"], static[best], strict=True)]
        medians = ", ".join(f"{p} {1e3 * statistics.median(t):.1f}" for p, t in times.items())
        print(
            f"{case:10s} {condition:10s} ms: {medians}; best static / dynamic "
            f"{statistics.median(static[best]) / statistics.median(times['dynamic']):.3f} "
            f"(paired median {1 / statistics.median(paired):.3f})"
        )
        for policy in (best, "dynamic"):
            per_rank = [r[key]["counts"][policy] for r in results]
            print(_line(policy, per_rank, times[policy]))
        fastest = min(statistics.median(t) for t in times.values())
        for policy, t in times.items():
            worst[policy] = max(worst.get(policy, 1.0), statistics.median(t) / fastest)
    print(
        "each policy's largest median step over the fastest policy's of the same case and "
        "condition: " + ", ".join(f"{p} {r:.3f}" for p, r in worst.items())
    )


if __name__ == "__main__":
    main()
