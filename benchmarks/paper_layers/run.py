"""The 2BP paper's layer sizes on one device: grouped W per operation, and the simulated step.

Prepared for one GPU (a minute or two on an H200, most of it start-up); it runs on a CPU
too, with smaller sizes:

    python benchmarks/paper_layers/run.py --out runs/paper-layers       # CUDA, LLaMA-7B, bf16
    python benchmarks/paper_layers/run.py --device cpu --dtype float32 --dim 256 \\
        --ffn-dim 688 --heads 4 --tokens 128                            # a CPU, small layers

**Part 1, W per operation.** For each linear layer shape of a LLaMA-7B decoder layer
(attention ``dim x dim``; gate and up ``dim -> ffn``; down ``ffn -> dim``), the weight
gradient of ``m`` micro-batches of ``--tokens`` rows each, three ways, alternated:

- *separate*: ``m`` products ``dY_i^T X_i``, each added into the gradient;
- *concatenated*: one product ``cat(dY)^T cat(X)`` (the concatenation timed too);
- *engine*: the 2BP engine's W over the ``m`` micro-batches, as a grouped W runs in a
  pipeline (it concatenates stashes up to ``twobp.engine.stash.CONCAT_ROWS`` rows).

The three gradients are checked against each other before anything is timed.

**Part 2, simulated step.** One decoder layer is profiled on the device (F, I, W and B of
one micro-batch; one W over ``k`` micro-batches), and a pipeline of ``--layers`` such layers
over ``--ranks`` devices (LLaMA-7B: 32 layers, the paper's 4 GPUs) is simulated for each
schedule as generated (gpipe, 1f1b and chimera with a fused backward; zb-h2 with its own
split, one W per micro-batch) and with 2BP placed by the ``paper`` and ``fill`` policies,
from the same costs, with each rank's peak memory of the cost model (activations, stashes,
weights). Transfers between stages and Chimera's
gradient all-reduce are left free (one device is measured, not the links): the figures are
what the schedule and the split backward give.

Prints markdown tables; ``--out DIR`` also writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from twobp.engine import defer_weight_grads
from twobp.models.llama import DecoderBlock, LlamaConfig
from twobp.partition.profiler import profile_blocks, synchronizer, weight_group_times
from twobp.sim.candidate import simulate_candidate
from twobp.sim.from_profile import partition_for, profiled_costs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SCHEDULES = ("gpipe", "1f1b", "zb-h2", "chimera")
POLICIES = ("off", "paper", "fill")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
"""Largest relative difference allowed between the three weight gradients (the sums
round differently in each)."""


def _relative(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def linear_shapes(dim: int, ffn_dim: int) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each distinct linear layer shape of a decoder layer."""
    return {"attention q/k/v/o": (dim, dim), "gate, up": (dim, ffn_dim), "down": (ffn_dim, dim)}


def weight_pass_times(
    d_in: int,
    d_out: int,
    rows: int,
    m: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
) -> dict[str, float]:
    """Seconds of the weight gradient of ``m`` micro-batches: separate, concatenated, engine.

    Raises:
        AssertionError: if the three ways disagree beyond :data:`TOLERANCE`.
    """
    generator = torch.Generator(device="cpu").manual_seed(0)
    layer = nn.Linear(d_in, d_out, bias=False).to(device=device, dtype=dtype)
    xs = [torch.randn(rows, d_in, generator=generator).to(device, dtype) for _ in range(m)]
    dys = [torch.randn(rows, d_out, generator=generator).to(device, dtype) for _ in range(m)]
    store = defer_weight_grads(layer)

    def separate() -> Tensor:
        grad = torch.zeros_like(layer.weight)
        for x, dy in zip(xs, dys, strict=True):
            grad.addmm_(dy.t(), x)
        return grad

    def concatenated() -> Tensor:
        return torch.mm(torch.cat(dys).t(), torch.cat(xs))

    def engine_inputs() -> None:  # F and I of every micro-batch, untimed
        for mb, (x, dy) in enumerate(zip(xs, dys, strict=True)):
            leaf = x.detach().requires_grad_()
            with store.forward(mb):
                out = layer(leaf)
            store.backward_input(mb, [out], [dy], [leaf])

    def engine() -> Tensor:
        store.backward_weight(range(m))
        grad = layer.weight.grad
        assert grad is not None
        layer.weight.grad = None
        store.finish_step()
        return grad

    try:
        engine_inputs()
        reference = separate()
        for name, grad in (("concatenated", concatenated()), ("engine", engine())):
            error = _relative(grad, reference)
            assert error <= TOLERANCE[dtype], (
                f"{name} W of a {d_in} -> {d_out} layer differs from the separate products "
                f"by {error:.2e} (relative)"
            )
        clock = synchronizer([layer.weight])
        ways = {"separate": separate, "concatenated": concatenated, "engine": engine}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for rep in range(repeats + 1):  # the first round warms up
            for name, way in ways.items():
                if name == "engine":
                    engine_inputs()
                start = clock()
                way()
                if rep:
                    times[name].append(clock() - start)
    finally:
        store.restore()
    return {name: statistics.median(t) for name, t in times.items()}


def layer_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        256,
        dim=args.dim,
        n_layers=1,
        n_heads=args.heads,
        ffn_dim=args.ffn_dim,
        seq_len=args.tokens,
    )


def profile_layer(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[Any, dict[int, float]]:
    """One decoder layer's costs on one micro-batch, and its W table."""
    torch.manual_seed(0)
    layer = DecoderBlock(layer_config(args)).to(device=device, dtype=dtype)
    x = torch.randn(1, args.tokens, args.dim, device=device, dtype=dtype)
    [cost] = profile_blocks([layer], x, repeats=args.repeats)
    counts = sorted({1, 2, 4, *args.microbatches})
    [table] = weight_group_times([layer], x, counts, repeats=args.repeats)
    return cost, table


def simulate_pipeline(
    cost: Any,
    table: dict[int, float],
    n_layers: int,
    n_ranks: int,
    m: int,
    *,
    schedules: Sequence[str] = SCHEDULES,
    policies: Sequence[str] = POLICIES,
) -> list[dict[str, Any]]:
    """Each schedule and policy simulated on ``n_layers`` copies of the profiled layer."""
    costs = profiled_costs(
        [cost] * n_layers, [table] * n_layers, partition_for(n_layers, "uniform", None)
    )
    rows = []
    for name in schedules:
        for policy in policies:
            c, _ = simulate_candidate(name, policy, n_ranks, m, costs)
            rows.append(
                {
                    "schedule": c.schedule,
                    "policy": c.policy,
                    "microbatches": m,
                    "step_s": c.makespan,
                    "bubble": c.bubble_ratio,
                    "peak_bytes": c.peak_memory,
                    "error": c.error,
                }
            )
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if math.isfinite(seconds) else "-"


def print_weight_table(results: Sequence[dict[str, Any]]) -> None:
    print(
        "\n| layer | in -> out | rows per micro-batch | m | separate ms | concatenated ms | "
        "engine ms | separate / concatenated |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        t = r["seconds"]
        print(
            f"| {r['layer']} | {r['in']} -> {r['out']} | {r['rows']} | {r['m']} "
            f"| {_ms(t['separate'])} | {_ms(t['concatenated'])} | {_ms(t['engine'])} "
            f"| {t['separate'] / t['concatenated']:.2f}x |"
        )


def print_step_table(rows: Sequence[dict[str, Any]], tokens: int) -> None:
    print(
        "\n| schedule | m | as generated ms | 2BP (paper) ms | 2BP (fill) ms "
        "| best 2BP / as generated | tokens/s, best 2BP | bubble, best 2BP "
        "| peak memory, best 2BP / as generated |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    keyed = {(r["schedule"], r["microbatches"], r["policy"]): r for r in rows}
    for m in sorted({r["microbatches"] for r in rows}):
        for name in SCHEDULES:
            off, paper, fill = (keyed.get((name, m, p)) for p in POLICIES)
            if off is None or paper is None or fill is None:
                continue
            best = min((paper, fill), key=lambda r: r["step_s"])
            gain = off["step_s"] / best["step_s"] if math.isfinite(best["step_s"]) else math.nan
            rate = m * tokens / best["step_s"] if math.isfinite(best["step_s"]) else math.nan
            memory = best["peak_bytes"] / off["peak_bytes"] if off["peak_bytes"] else math.nan
            print(
                f"| {name} | {m} | {_ms(off['step_s'])} | {_ms(paper['step_s'])} "
                f"| {_ms(fill['step_s'])} | {gain:.2f}x | {rate:,.0f} | {best['bubble']:.3f} "
                f"| {memory:.2f}x |"
            )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, measure, print; the results (also in ``--out``'s results.json)."""
    return measure(argv)[0]


def measure(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], Any, dict[int, float]]:
    """:func:`main`, and the profiled layer's costs and W table (to simulate more from)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--dim", type=int, default=4096, help="hidden width (LLaMA-7B: 4096)")
    parser.add_argument("--ffn-dim", type=int, default=11008, help="MLP width (LLaMA-7B: 11008)")
    parser.add_argument("--heads", type=int, default=32, help="attention heads (LLaMA-7B: 32)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the model")
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks to simulate")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--out", help="a folder for results.json")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"{hardware}, torch {torch.__version__}, {args.dtype}, dim {args.dim}, "
        f"MLP {args.ffn_dim}, {args.tokens} tokens per micro-batch"
    )

    weights = []
    for name, (d_in, d_out) in linear_shapes(args.dim, args.ffn_dim).items():
        for m in args.microbatches:
            seconds = weight_pass_times(d_in, d_out, args.tokens, m, device, dtype, args.repeats)
            weights.append(
                {
                    "layer": name,
                    "in": d_in,
                    "out": d_out,
                    "rows": args.tokens,
                    "m": m,
                    "seconds": seconds,
                }
            )
    print_weight_table(weights)

    cost, table = profile_layer(args, device, dtype)
    print(
        f"\nOne decoder layer, one micro-batch: F {_ms(cost.forward)} ms, I "
        f"{_ms(cost.backward_input)} ms, W {_ms(cost.backward_weight)} ms, B "
        f"{_ms(cost.backward_full)} ms; one W over k micro-batches: "
        + ", ".join(f"k={k} {_ms(t)} ms" for k, t in sorted(table.items()))
    )
    steps = [
        row
        for m in args.microbatches
        for row in simulate_pipeline(cost, table, args.layers, args.ranks, m)
    ]
    print(f"\nSimulated: {args.layers} layers on {args.ranks} ranks, transfers free")
    print_step_table(steps, args.tokens)

    results = {
        "hardware": hardware,
        "torch": torch.__version__,
        "args": vars(args),
        "weight_pass": weights,
        "layer": {
            "forward": cost.forward,
            "backward_input": cost.backward_input,
            "backward_weight": cost.backward_weight,
            "backward_full": cost.backward_full,
            "weight_concat": {str(k): t for k, t in table.items()},
        },
        "simulated": steps,
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    return results, cost, table


if __name__ == "__main__":
    main()
