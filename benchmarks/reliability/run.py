"""What reliability costs: the start-of-step agreement, the model check, checkpoints.

1. Per step, 2 ranks over gloo: the barrier that used to open every step against
   the all-reduce that replaces it (which also tells every rank whether any
   rank's batch is missing or does not split, and compares call, step count and
   batch size), and the whole start of a step (splitting the batch included).
   Interleaved rounds, medians in microseconds.
2. Once per pipeline: the fingerprint of every block (names, shapes, dtypes and
   a sample of values) that the ranks compare at construction.
3. Per checkpoint, one process: save (fsync and rename included) and load of
   the LLaMA-like presets with their AdamW state.

    .venv/bin/python benchmarks/reliability/run.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from twobp.models import build_model
from twobp.runtime import Pipeline, launch

ROUNDS = 30
CALLS = 100


def step_start_costs(calls: int) -> dict[str, float]:
    """On every rank: median microseconds per call of each way to open a step."""
    import torch.distributed as dist

    from twobp.runtime.base.group import join_world
    from twobp.runtime.communication import collective
    from twobp.runtime.communication.agreement import agree_small, small_buffer
    from twobp.runtime.execution.step_start import StepInputs, start_step

    device = torch.device("cpu")
    world = join_world(device, 30.0)
    buffer = small_buffer(world.size, device)
    batch = torch.zeros(8, 4)
    ways = {
        "barrier (before)": lambda: collective.barrier(world, 30.0, "bench"),
        "agreement all-reduce": lambda: agree_small(world, device, 30.0, None, "bench", 5, buffer),
        "start of a step (split + agreement)": lambda: start_step(
            world, device, 30.0, StepInputs(batch, batch, True, 0), (0, 1), 4, buffer
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, call in ways.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def checkpoint_costs(size: str) -> dict[str, Any]:
    """Save and load times of one LLaMA-like preset with its AdamW state."""
    from twobp.runtime.setup.fingerprint import block_print

    spec = build_model("llama", size, seed=0, vocab_size=256, seq_len=64)
    blocks = list(spec.blocks)
    start = time.perf_counter()
    for block in blocks:
        block_print(block)
    fingerprint = time.perf_counter() - start
    pipe = Pipeline(blocks, spec.loss_fn, n_microbatches=2, device="cpu")
    optimizer = torch.optim.AdamW(pipe.parameters())
    tokens = torch.randint(0, 256, (2, 64))
    pipe.step(tokens, tokens)
    optimizer.step()
    folder = tempfile.mkdtemp()
    saves = []
    for step in range(3):
        start = time.perf_counter()
        path = pipe.save(folder, optimizer, step=step)
        saves.append(time.perf_counter() - start)
    start = time.perf_counter()
    pipe.load(folder, optimizer)
    load = time.perf_counter() - start
    return {
        "parameters": sum(p.numel() for p in pipe.parameters()),
        "MiB": sum(f.stat().st_size for f in path.iterdir()) / 2**20,
        "save_ms": min(saves) * 1e3,
        "load_ms": load * 1e3,
        "fingerprint_ms": fingerprint * 1e3,
        "blocks": len(blocks),
    }


def main() -> None:
    torch.set_num_threads(1)
    costs = launch(step_start_costs, 2, CALLS, threads_per_rank=1)[0]
    print("start of a step, 2 ranks, gloo (median us per call):")
    for name, micros in costs.items():
        print(f"  {name:<38} {micros:8.0f}")
    print("checkpoints, one process (AdamW state included):")
    for size in ("tiny", "small"):
        c = checkpoint_costs(size)
        print(
            f"  llama {size}: {c['parameters'] / 1e6:.2f} M parameters, {c['MiB']:.1f} MiB, "
            f"save {c['save_ms']:.0f} ms, load {c['load_ms']:.0f} ms; fingerprint of "
            f"{c['blocks']} blocks {c['fingerprint_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
