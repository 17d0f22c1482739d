"""A tensor-parallel training step on 2 ranks: twobp against torch's ``parallelize_module``.

Both split the same LLaMA-like model's decoder linears over the 2 ranks
(q, k, v, w1, w3 column-wise; o, w2 row-wise) and run the same batch in the
same micro-batches, gradients accumulated: twobp as ``Pipeline(tensor_parallel=2)``
with one pipeline rank (with and without 2BP), torch as ``parallelize_module``
(DTensor, ``ColwiseParallel``/``RowwiseParallel``) on a 1-D mesh with a plain
backward per micro-batch. One thread per rank, gloo; the variants take turns
step by step; medians of the timed rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel/run.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from twobp.models import build_model, tensor_parallel_plan
from twobp.runtime import Pipeline, launch

MODEL = {"dim": 512, "n_heads": 8, "ffn_dim": 1376, "n_layers": 4, "seq_len": 64}


def _torch_variant(blocks: list[torch.nn.Module]) -> torch.nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in tensor_parallel_plan("llama").items()}
    for block in blocks[1:-1]:
        parallelize_module(block, mesh, plan)
        for module in block.modules():
            heads = getattr(module, "n_heads", None)
            if isinstance(heads, int):
                vars(module)["n_heads"] = heads // dist.get_world_size()
    return torch.nn.Sequential(*blocks)


def _rank(microbatches: int, batch: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    spec = build_model("llama", "small", **MODEL)
    inputs, targets = spec.make_batch(batch, 0)
    variants: dict[str, Any] = {}
    for two_bp in (True, False):
        pipe = Pipeline(
            copy.deepcopy(spec.blocks),
            spec.loss_fn,
            "1f1b",
            n_microbatches=microbatches,
            two_bp=two_bp,
            tensor_parallel=2,
            tensor_parallel_plan=tensor_parallel_plan("llama"),
        )
        variants[f"twobp{' + 2BP' if two_bp else ''}"] = lambda p=pipe: p.step(inputs, targets)
    model = _torch_variant(copy.deepcopy(spec.blocks))
    xs, ys = inputs.tensor_split(microbatches), targets.tensor_split(microbatches)

    def torch_step() -> None:
        for x, y in zip(xs, ys, strict=True):
            (spec.loss_fn(model(x), y) * (len(x) / batch)).backward()

    variants["torch parallelize_module"] = torch_step
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds + 2):
        for name, step in variants.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    medians = launch(
        _rank, 2, args.microbatches, args.batch, args.rounds, threads_per_rank=1, timeout=900
    )[0]
    torch_time = medians["torch parallelize_module"]
    print("| variant | step ms | torch / variant |")
    print("|---|---:|---:|")
    for name, t in medians.items():
        print(f"| {name} | {t * 1e3:.1f} | {torch_time / t:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
