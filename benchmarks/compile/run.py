"""torch.compile with 2BP: twobp's compiled pipeline against eager, plain compile and torch's.

For each LLaMA-like regime of ``twobp bench`` (``large``, ``small``: 6 blocks, an
embedding, 4 decoders and the head), with m micro-batches per step:

- *plain*: one process, one thread, every micro-batch forward and backward through
  the whole model by plain autograd, eager and with each block ``torch.compile``-d
  (inductor): the speed-up compile gives plain autograd on these blocks (freed memory
  kept in the process, as every CPU pipeline keeps it, here and in *stage*);
- *stage*: one process, one thread, the two middle decoder blocks as one stage, plain
  autograd and the 2BP engine (F and I of each micro-batch, then one W), each eager and
  compiled (plain: each block ``torch.compile``-d; twobp: the stage compiled whole by
  ``compile_for_two_stage``, as ``Pipeline(..., compile=True)`` compiles a 2BP stage):
  what compile changes in a stage's own compute, without the pipeline's sends and waits;
- *pipelines*: 2 ranks (gloo, one thread each), 1F1B over 2 stages: twobp with 2BP
  eager, with ``compile=True`` (each stage compiled or eager, the faster in its first
  training steps, which the warm-up runs; each region between the calls that read
  parameters compiled or eager, the faster way timed on its first call; the RMS norms'
  normalisation compiled with the region before them), with every stage compiled
  (``compile={"stages": "compiled"}``), and so with every region compiled
  (``"regions": "compiled"``) and with the RMS norms routed whole (``"norms": "routed"``,
  run eagerly by the capture);
  ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` and ``ScheduleGPipe`` with eager and with compiled stages.

Every variant is built first and warmed up (compiled), then the variants step in
turn, round after round (each eager variant back to back with its compiled one, the pairs
and the two in each pair in an order shuffled each round), so that the machine's load and
the cache each variant finds weigh on all alike; the
figures are medians over rounds of the slowest rank's step time, and of its main
thread's CPU time in the step (which a busy machine does not inflate).

    PYTHONPATH=src:tools python benchmarks/compile/run.py [--regimes large small] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import random
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


def _retained() -> None:
    """Keep freed memory in this process, as every CPU ``Pipeline`` does
    (``retain_host_memory=True``), so that the one-process figures do not count the page
    faults that the pipelines' do not."""
    from twobp.runtime.setup.host_memory import retain_freed_memory

    retain_freed_memory()


def _spec(regime: str) -> Any:
    import torch

    from twobp.models.presets import build_model
    from twobp_bench.config import REGIMES

    r = REGIMES[regime]
    return build_model("llama", "tiny", dtype=torch.float32, seed=0, **dict(r.overrides)), r


def _plain(regime: str, rounds: int) -> dict[str, Any]:
    """Median step of plain autograd over the micro-batches, eager and compiled."""
    import torch

    torch._dynamo.reset()  # this regime's shapes, compiled static (as in a rank's process)

    torch.set_num_threads(1)
    _retained()
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

    return _interleaved(
        {"plain eager": step(eager_blocks), "plain compile": step(compiled_blocks)}, rounds
    )


def _stage(regime: str, rounds: int) -> dict[str, Any]:
    """Median step of one stage in one process: plain autograd and the 2BP engine, each
    eager and compiled, over the same micro-batches.

    The stage is the model's two middle decoder blocks, fed the embedding's outputs;
    the engine runs F and I of each micro-batch, then one W over all of them, as a
    stage of 1F1B + 2BP does. Without the other rank, the sends and the waits, this is
    the figure that compile changes, with less of the pipeline's noise around it.
    """
    import torch
    from torch import nn

    from twobp.engine import defer_weight_grads
    from twobp.engine.compiled import compile_for_two_stage

    torch.set_num_threads(1)
    torch._dynamo.reset()  # this regime's shapes, compiled static (as in a rank's process)
    _retained()
    spec, r = _spec(regime)
    inputs, _ = spec.make_batch(r.microbatch_size * M, 0)
    with torch.no_grad():
        hs = [spec.blocks[0](x) for x in inputs.chunk(M)]

    def stage(compiled: bool, engine: bool) -> nn.Module:
        module = nn.Sequential(*_spec(regime)[0].blocks[1:3])
        if compiled and engine:
            compile_for_two_stage(module)
        elif compiled:
            for block in module:
                block.compile()
        return module

    def plain(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            for h in hs:
                out = module(h.detach().requires_grad_())
                out.backward(torch.ones_like(out))

        return run

    def two_stage(module: nn.Module) -> Callable[[], None]:
        store = defer_weight_grads(module)

        def run() -> None:
            for mb, h in enumerate(hs):
                x = h.detach().requires_grad_()
                with store.forward(mb):
                    out = module(x)
                store.backward_input(mb, [out], [torch.ones_like(out)], [x])
            store.backward_weight(range(M))
            store.finish_step()

        return run

    return _interleaved(
        {
            "plain eager": plain(stage(False, False)),
            "plain compile": plain(stage(True, False)),
            "twobp eager": two_stage(stage(False, True)),
            "twobp compile": two_stage(stage(True, True)),
        },
        rounds,
    )


def _interleaved(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in steps}
    for _ in range(WARMUP):
        for run in steps.values():
            run()
    for k in range(rounds):
        for name, run in _in_turn(steps, k):
            start, cpu = time.perf_counter(), time.thread_time()
            run()
            times[name]["cpu"].append(time.thread_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - start)
    return _medians(times)


def _pairs(names: list[str]) -> list[list[str]]:
    """The variants grouped as each eager one with its compiled one (``X eager`` or ``X``
    with ``X compile``), the others alone, in their order."""
    groups: list[list[str]] = []
    placed: set[str] = set()
    for name in names:
        if name in placed:
            continue
        partner = f"{name.removesuffix(' eager')} compile"
        group = [name] + ([partner] if partner in names and partner not in placed else [])
        placed.update(group)
        groups.append(group)
    return groups


def _in_turn(steps: dict[str, Callable[[], None]], k: int) -> list[tuple[str, Callable[[], None]]]:
    """Round ``k``'s order of the variants, the same on every rank: each eager variant next to
    its compiled one, the pairs and the two in each pair shuffled by the round's number. A
    pair runs back to back, so that the machine's speed, which moves over seconds, is the
    same for both; and no variant always runs after the same other one (what ran before a
    step sets what of its data is still in cache)."""
    rng = random.Random(k)
    groups = _pairs(list(steps))
    rng.shuffle(groups)
    order: list[str] = []
    for group in groups:
        rng.shuffle(group)
        order.extend(group)
    return [(name, steps[name]) for name in order]


def _medians(times: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Each variant's median per clock, and under ``"speed-up"`` the round-by-round ratio
    eager / compiled of each pair run in the same rounds (its quartiles: a round's pair
    shares the machine's state, which moves between rounds)."""
    out: dict[str, Any] = {
        c: {k: statistics.median(v[c]) for k, v in times.items()} for c in CLOCKS
    }
    speedups: dict[str, dict[str, list[float]]] = {c: {} for c in CLOCKS}
    for group in _pairs(list(times)):
        if len(group) != 2:
            continue
        eager, compiled = group
        for c in CLOCKS:
            ratios = [a / b for a, b in zip(times[eager][c], times[compiled][c], strict=True)]
            speedups[c][compiled.removesuffix(" compile")] = statistics.quantiles(ratios, n=4)
    out["speed-up"] = speedups
    return out


def _share(two: float, gain: float) -> str:
    return f"{(two - 1) / (gain - 1) * 100:.0f}%" if gain != 1 else "nan"


def _quartiles(q: list[float]) -> str:
    return f"{q[1]:.3f}x [{q[0]:.3f}-{q[2]:.3f}]"


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


def _pipelines(regime: str, rounds: int) -> dict[str, Any]:
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
        ("twobp compile, stages compiled", {"stages": "compiled"}),
        ("twobp compile, regions compiled", {"regions": "compiled", "stages": "compiled"}),
        ("twobp compile, norms routed", {"norms": "routed", "stages": "compiled"}),
    )
    pipes = {}
    for name, compile_ in variants:
        spec = _spec(regime)[0]
        pipe = twobp.Pipeline(
            spec.blocks, spec.loss_fn, schedule="1f1b", n_microbatches=M, compile=compile_
        )

        def step(pipe: Any = pipe) -> None:
            pipe.zero_grad()
            pipe.step(inputs, targets)

        steps[name] = step
        pipes[name] = pipe
    for schedule in ("1F1B", "GPipe"):
        for compiled in (False, True):
            name = f"torch {schedule}{' compile' if compiled else ''}"
            steps[name] = _torch_pipeline(
                _spec(regime)[0], schedule, compiled, rank, inputs, targets
            )
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in steps}
    # Every variant warmed up (compiled), in shuffled orders as the rounds; then
    # compile=True's trial of each stage (compiled or eager), which ends its choice, as a
    # training run makes it: its steps one after another. Run between other variants'
    # steps, its steps took up to a fifth longer either way, at random, where the two ways
    # differ by a few per cent, and it kept stages eager that ran faster compiled.
    for k in range(WARMUP):
        for _, run in _in_turn(steps, -1 - k):
            run()
    from twobp.runtime.setup import compile_trial

    for _ in range(compile_trial.WARMUP + 2 * compile_trial.TRIALS - WARMUP):
        steps["twobp compile"]()
    trial = pipes["twobp compile"]._compile_trial
    choices: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(choices, pipes["twobp compile"].compile_choice)
    trials: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(trials, trial.times if trial is not None else {})
    for k in range(rounds):
        for name, run in _in_turn(steps, k):
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            run()
            cpu = time.thread_time() - cpu
            elapsed = torch.tensor([time.perf_counter() - start, cpu])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name]["wall"].append(float(elapsed[0]))
            times[name]["cpu"].append(float(elapsed[1]))
    out = _medians(times)
    out["compile choice"] = {s: way for c in choices for s, way in c.items()}
    out["compile trial ms"] = {
        s: {way: [round(t * 1e3, 1) for t in ts] for way, ts in times.items()}
        for t in trials
        for s, times in t.items()
    }
    return out


def _print(regime: str, clock: str, plain_run: dict[str, Any], piped_run: dict[str, Any],
           rounds: int) -> None:  # fmt: skip
    plain, piped = plain_run[clock], piped_run[clock]
    plain_speedups, piped_speedups = plain_run["speed-up"][clock], piped_run["speed-up"][clock]
    gain = plain["plain eager"] / plain["plain compile"]
    two = piped["twobp eager"] / piped["twobp compile"]
    print(f"\n{regime}: m = {M}, {CLOCKS[clock]} in ms (medians of {rounds} rounds)")
    print(
        f"  plain autograd, 1 process: eager {plain['plain eager'] * 1e3:.1f}, "
        f"compile {plain['plain compile'] * 1e3:.1f}: speed-up {gain:.3f}x"
    )
    for name, t in piped.items():
        print(
            f"  {name:<32} {t * 1e3:8.1f}   twobp compile vs this: "
            f"{t / piped['twobp compile']:.3f}x"
        )
    print(
        f"  twobp compile speed-up over twobp eager {two:.3f}x = {_share(two, gain)} of "
        f"plain's gain"
    )
    print(
        f"  compile=True's choice per stage: {piped_run['compile choice']}, from its trial's "
        f"compute per step (ms): {piped_run.get('compile trial ms')}"
    )
    print(
        f"  round by round (median [quartiles]): plain {_quartiles(plain_speedups['plain'])}, "
        f"twobp {_quartiles(piped_speedups['twobp'])}, torch 1F1B "
        f"{_quartiles(piped_speedups['torch 1F1B'])}, torch GPipe "
        f"{_quartiles(piped_speedups['torch GPipe'])}: twobp's share of plain's gain "
        f"{_share(piped_speedups['twobp'][1], plain_speedups['plain'][1])}"
    )


def _print_stage(regime: str, clock: str, stage: dict[str, Any]) -> None:
    times, speedups = stage[clock], stage["speed-up"][clock]
    print(f"\n{regime}: one stage (2 decoder blocks), 1 process, m = {M}, CPU ms per step")
    print("  " + ", ".join(f"{name} {t * 1e3:.1f}" for name, t in times.items()))
    plain, two = speedups["plain"], speedups["twobp"]
    print(
        f"  compile's speed-up, round by round (median [quartiles]): plain {_quartiles(plain)}, "
        f"twobp {_quartiles(two)} = {_share(two[1], plain[1])} of plain's gain"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", nargs="+", default=["large", "small"])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    import twobp

    table = {}
    for regime in args.regimes:
        stage = _stage(regime, args.rounds)
        plain = _plain(regime, args.rounds)
        piped = twobp.launch(_pipelines, 2, regime, args.rounds, threads_per_rank=1)[0]
        table[regime] = {"stage": stage, "plain": plain, "pipelines": piped}
        _print_stage(regime, "cpu", stage)
        for clock in CLOCKS:
            _print(regime, clock, plain, piped, args.rounds)
    print(json.dumps(table))


if __name__ == "__main__":
    main()
