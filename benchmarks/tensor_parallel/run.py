"""A tensor-parallel training step: twobp against torch's ``parallelize_module``.

Both split the same LLaMA-like model's decoder linears over 2 tensor-parallel ranks
(q, k, v, w1, w3 column-wise; o, w2 row-wise) and run the same batch in the same
micro-batches, gradients accumulated.

- ``--pipeline 1`` (2 ranks): twobp as ``Pipeline(tensor_parallel=2)`` with one pipeline
  rank (with and without 2BP, with the ``dynamic`` 2BP policy); torch as
  ``parallelize_module`` (DTensor, ``ColwiseParallel``/``RowwiseParallel``) on a 1-D mesh
  with a plain backward per micro-batch.
- ``--pipeline 2`` (4 ranks, 2 x 2, pipeline x tensor, tensor parallel innermost):
  twobp as ``Pipeline(tensor_parallel=2)`` on 4 ranks (1f1b with and without 2BP, 1f1b
  with the ``dynamic`` 2BP policy, zb-h1); torch as ``parallelize_module`` on the ``tp``
  dim of a 2-D ``(pp, tp)`` mesh and ``torch.distributed.pipelining``'s ``Schedule1F1B``
  over the ``pp`` dim (the loss scaled by ``1/m``, ``scale_grads=False``: the gradients
  twobp computes). Both cut the 6 blocks 3 + 3.

One thread per rank, gloo; the variants take turns step by step; medians of the timed
rounds (the slowest rank's step, as every rank waits for the others). A second table
gives, per twobp variant, the time its backwards spent in the tensor-parallel all-reduces
of input gradients and how much of it ran stored ``W`` (the ``dynamic`` policy runs them
there, a layer at a time, while the all-reduce is in flight).

    PYTHONPATH=src .venv/bin/python benchmarks/tensor_parallel/run.py [--pipeline 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.models import build_model, tensor_parallel_plan
from twobp.runtime import Pipeline, launch

MODEL = {"dim": 512, "n_heads": 8, "ffn_dim": 1376, "n_layers": 4, "seq_len": 64}
TENSOR_PARALLEL = 2
TORCH = "torch parallelize_module"


def _split_decoders(blocks: list[nn.Module], tp_mesh: Any) -> None:
    """``parallelize_module`` on every decoder block of ``blocks`` over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in tensor_parallel_plan("llama").items()}
    for block in blocks:
        if not any(n.startswith("attn.") for n, _ in block.named_modules()):
            continue  # the embedding and the head stay whole, as in twobp's runs
        parallelize_module(block, tp_mesh, plan)
        for module in block.modules():
            heads = getattr(module, "n_heads", None)
            if isinstance(heads, int):
                vars(module)["n_heads"] = heads // tp_mesh.size()


class _Stage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> Any:
        return self.blocks(x)


Step = Callable[[], float | None]
"""One training step; the loss where this rank has it."""


def _torch_tensor_parallel(spec: Any, inputs: Any, targets: Any, m: int) -> Step:
    from torch.distributed.device_mesh import init_device_mesh

    blocks = copy.deepcopy(spec.blocks)
    _split_decoders(blocks, init_device_mesh("cpu", (dist.get_world_size(),)))
    model = nn.Sequential(*blocks)
    xs, ys = inputs.tensor_split(m), targets.tensor_split(m)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(xs, ys, strict=True):
            loss = spec.loss_fn(model(x), y) * (len(x) / len(inputs))
            loss.backward()
            total += float(loss.detach())
        return total

    return step


def _torch_pipelined(spec: Any, inputs: Any, targets: Any, m: int) -> Step:
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    pipeline = dist.get_world_size() // TENSOR_PARALLEL
    mesh = init_device_mesh("cpu", (pipeline, TENSOR_PARALLEL), mesh_dim_names=("pp", "tp"))
    stage_index = mesh.get_local_rank("pp")
    per_stage = len(spec.blocks) // pipeline
    blocks = copy.deepcopy(spec.blocks)[per_stage * stage_index : per_stage * (stage_index + 1)]
    _split_decoders(blocks, mesh["tp"])
    module = _Stage(blocks)
    stage = pipelining.PipelineStage(
        module, stage_index, pipeline, torch.device("cpu"), group=mesh.get_group("pp")
    )

    def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return spec.loss_fn(output, target) / m  # type: ignore[no-any-return]

    schedule = pipelining.Schedule1F1B(stage, m, loss_fn=scaled, scale_grads=False)

    def step() -> float | None:
        module.zero_grad(set_to_none=True)
        if stage_index == 0:
            schedule.step(inputs, return_outputs=False)
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=targets, losses=losses, return_outputs=False)
        return float(sum(float(loss.detach()) for loss in losses))

    return step


def _rank(pipeline: int, microbatches: int, batch: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    spec = build_model("llama", "small", **MODEL)
    inputs, targets = spec.make_batch(batch, 0)
    runs = [("1f1b", "paper"), ("1f1b", None), ("1f1b", "dynamic")]
    runs += [("zb-h1", "paper")] if pipeline > 1 else []
    variants: dict[str, Any] = {}
    pipes: dict[str, Pipeline] = {}
    for schedule, policy in runs:
        pipe = Pipeline(
            copy.deepcopy(spec.blocks),
            spec.loss_fn,
            schedule,
            n_microbatches=microbatches,
            two_bp=policy is not None,
            two_bp_policy=policy or "paper",
            partition=[len(spec.blocks) // pipeline] * pipeline,
            tensor_parallel=TENSOR_PARALLEL,
            tensor_parallel_plan=tensor_parallel_plan("llama"),
        )
        name = f"twobp {schedule}" if pipeline > 1 else "twobp"
        name += "" if policy is None else " + 2BP" if policy == "paper" else f" + 2BP {policy}"
        variants[name] = lambda p=pipe: p.step(inputs, targets)
        pipes[name] = pipe
    make = _torch_pipelined if pipeline > 1 else _torch_tensor_parallel
    name = f"{TORCH} + pipelining 1F1B" if pipeline > 1 else TORCH
    variants[name] = make(spec, inputs, targets, microbatches)
    times: dict[str, list[float]] = {name: [] for name in variants}
    reducing = {name: [0.0, 0.0] for name in pipes}  # all-reduce seconds, W seconds in them
    losses: dict[str, float | None] = {}
    for round_ in range(rounds + 2):
        for name, step in variants.items():
            dist.barrier()
            start = time.perf_counter()
            losses[name] = step()
            dist.barrier()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
                if name in pipes:
                    counts = pipes[name].step_times
                    reducing[name][0] += counts.reducing / rounds
                    reducing[name][1] += counts.weight_seconds_in_reductions / rounds
    # No optimizer step: every round computes the same loss, so the variants' agree.
    known = [loss for loss in losses.values() if loss is not None]
    spread = max(known) - min(known) if len(known) == len(losses) else None
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {"medians": medians, "spread": spread, "reducing": reducing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=int, default=1, choices=(1, 2))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    ranks = args.pipeline * TENSOR_PARALLEL
    results = launch(
        _rank,
        ranks,
        args.pipeline,
        args.microbatches,
        args.batch,
        args.rounds,
        threads_per_rank=1,
        timeout=1800,
    )
    medians = results[0]["medians"]
    spread = results[-1]["spread"]  # the last stage has every variant's loss
    print(f"largest difference of the variants' losses (float32): {spread:.2e}")
    torch_time = next(t for name, t in medians.items() if name.startswith(TORCH))
    print("| variant | step ms | torch / variant |")
    print("|---|---:|---:|")
    for name, t in medians.items():
        print(f"| {name} | {t * 1e3:.1f} | {torch_time / t:.2f} |")
    print()
    print("Tensor-parallel all-reduces of the backward (I, or B without 2BP), per step,")
    print("mean over the ranks; W: the stored W run while one was in flight.")
    print("| variant | all-reduce ms | W in them ms | share of the all-reduce time |")
    print("|---|---:|---:|---:|")
    for name in results[0]["reducing"]:
        total = statistics.mean(r["reducing"][name][0] for r in results)
        hidden = statistics.mean(r["reducing"][name][1] for r in results)
        print(f"| {name} | {total * 1e3:.1f} | {hidden * 1e3:.1f} | {hidden / total:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
