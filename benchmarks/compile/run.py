"""torch.compile with 2BP: twobp's compiled pipeline against eager, plain compile and torch's.

For each LLaMA-like regime of ``twobp bench`` (``large``, ``small``: 6 blocks, an
embedding, 4 decoders and the head), with m micro-batches per step:

- *plain*: one process, one thread, every micro-batch forward and backward through
  the whole model by plain autograd, eager and with each block ``torch.compile``-d
  (inductor): the speed-up compile gives plain autograd on these blocks;
- *pipelines*: 2 ranks (gloo, one thread each), 1F1B over 2 stages: twobp with 2BP
  eager, with ``compile=True`` (each region between the calls that read parameters
  compiled or eager, the faster way timed on its first call; the RMS norms'
  normalisation compiled with the region before them), with every region
  compiled (``compile={"regions": "compiled"}``) and with the RMS norms routed whole
  (``compile={"norms": "routed"}``, run eagerly by the capture);
  ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` and ``ScheduleGPipe`` with eager and with compiled stages.

Every variant is built first and warmed up (compiled), then the variants step in
turn, round after round, so that the machine's load weighs on all alike; the
figures are medians over rounds of the slowest rank's step time, and of its main
thread's CPU time in the step (which a busy machine does not inflate).

    PYTHONPATH=src:tools python benchmarks/compile/run.py [--regimes large small] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

M = 4
WARMUP = 3
CLOCKS = {
    "wall": "step times",
    "cpu": "main-thread CPU time per step (the slowest rank's)",
}
"""The two clocks: the step as it is, and the CPU time each rank's main thread spent in
it, which other work on a busy machine does not inflate (nor does it count a rank's waits
on the other)."""


def _spec(regime: str) -> Any:
    import torch

    from twobp.models.presets import build_model
    from twobp_bench.config import REGIMES

    r = REGIMES[regime]
    return build_model("llama", "tiny", dtype=torch.float32, seed=0, **dict(r.overrides)), r


def _plain(regime: str, rounds: int) -> dict[str, dict[str, float]]:
    """Median step of plain autograd over the micro-batches, eager and compiled."""
    import torch

    torch.set_num_threads(1)
    spec, r = _spec(regime)
    inputs, targets = spec.make_batch(r.microbatch_size * M, 0)
    from twobp.runtime.execution.microbatch import split_batch

    xs, ys = split_batch(inputs, M), split_batch(targets, M)
    eager_blocks = _spec(regime)[0].blocks
    compiled_blocks = [torch.compile(b) for b in _spec(regime)[0].blocks]

    def step(blocks: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for x, y in zip(xs, ys, strict=True):
                h = x
                for b in blocks:
                    h = b(h)
                (spec.loss_fn(h, y) / M).backward()

        return run

    return _interleaved({"eager": step(eager_blocks), "compile": step(compiled_blocks)}, rounds)


def _interleaved(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, dict[str, float]]:
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in steps}
    for _ in range(WARMUP):
        for run in steps.values():
            run()
    for _ in range(rounds):
        for name, run in steps.items():
            start, cpu = time.perf_counter(), time.thread_time()
            run()
            times[name]["cpu"].append(time.thread_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - start)
    return _medians(times)


def _medians(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {c: {k: statistics.median(v[c]) for k, v in times.items()} for c in CLOCKS}


def _torch_pipeline(
    spec: Any, schedule: str, compiled: bool, rank: int, inputs: Any, targets: Any
) -> Callable[[], None]:
    import torch
    import torch.distributed.pipelining as pipelining

    from twobp_bench.torch_pipelining import ScaledLoss, StageModule

    blocks = spec.blocks[:3] if rank == 0 else spec.blocks[3:]
    if compiled:
        blocks = [torch.compile(b) for b in blocks]
    module = StageModule(blocks)
    stage = pipelining.PipelineStage(module, rank, 2, torch.device("cpu"))
    cls = {"1F1B": pipelining.Schedule1F1B, "GPipe": pipelining.ScheduleGPipe}[schedule]
    run = cls(stage, M, loss_fn=ScaledLoss(spec.loss_fn, M), scale_grads=False)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        if rank == 0:
            run.step(inputs, return_outputs=False)
        else:
            run.step(target=targets, return_outputs=False)

    return step


def _pipelines(regime: str, rounds: int) -> dict[str, dict[str, float]]:
    """On every rank: median step of each pipeline variant, the slowest rank's."""
    import torch
    import torch.distributed as dist

    import twobp

    rank = dist.get_rank()
    _, r = _spec(regime)
    inputs, targets = _spec(regime)[0].make_batch(r.microbatch_size * M, 0)
    steps: dict[str, Callable[[], None]] = {}
    variants: tuple[tuple[str, Any], ...] = (
        ("twobp eager", False),
        ("twobp compile", True),
        ("twobp compile, regions compiled", {"regions": "compiled"}),
        ("twobp compile, norms routed", {"norms": "routed"}),
    )
    for name, compile_ in variants:
        spec = _spec(regime)[0]
        pipe = twobp.Pipeline(
            spec.blocks, spec.loss_fn, schedule="1f1b", n_microbatches=M, compile=compile_
        )

        def step(pipe: Any = pipe) -> None:
            pipe.zero_grad()
            pipe.step(inputs, targets)

        steps[name] = step
    for schedule in ("1F1B", "GPipe"):
        for compiled in (False, True):
            name = f"torch {schedule}{' compile' if compiled else ''}"
            steps[name] = _torch_pipeline(
                _spec(regime)[0], schedule, compiled, rank, inputs, targets
            )
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in steps}
    for _ in range(WARMUP):
        for run in steps.values():
            run()
    for _ in range(rounds):
        for name, run in steps.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            run()
            cpu = time.thread_time() - cpu
            elapsed = torch.tensor([time.perf_counter() - start, cpu])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name]["wall"].append(float(elapsed[0]))
            times[name]["cpu"].append(float(elapsed[1]))
    return _medians(times)


def _print(
    regime: str, clock: str, plain: dict[str, float], piped: dict[str, float], rounds: int
) -> None:
    gain = plain["eager"] / plain["compile"]
    two = piped["twobp eager"] / piped["twobp compile"]
    print(f"\n{regime}: m = {M}, {CLOCKS[clock]} in ms (medians of {rounds} rounds)")
    print(
        f"  plain autograd, 1 process: eager {plain['eager'] * 1e3:.1f}, "
        f"compile {plain['compile'] * 1e3:.1f}: speed-up {gain:.3f}x"
    )
    for name, t in piped.items():
        print(
            f"  {name:<32} {t * 1e3:8.1f}   twobp compile vs this: "
            f"{t / piped['twobp compile']:.3f}x"
        )
    print(
        f"  twobp compile speed-up over twobp eager {two:.3f}x = "
        f"{(two - 1) / (gain - 1) * 100 if gain != 1 else float('nan'):.0f}% of plain's gain"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", nargs="+", default=["large", "small"])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    import twobp

    table = {}
    for regime in args.regimes:
        plain = _plain(regime, args.rounds)
        piped = twobp.launch(_pipelines, 2, regime, args.rounds, threads_per_rank=1)[0]
        table[regime] = {"plain": plain, "pipelines": piped}
        for clock in CLOCKS:
            _print(regime, clock, plain[clock], piped[clock], args.rounds)
    print(json.dumps(table))


if __name__ == "__main__":
    main()
