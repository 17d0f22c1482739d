"""What 2BP costs per decoder block of the bench's two LLaMA regimes.

One decoder block, m micro-batches, three ways, interleaved (A B C A B C ...)
after a warm-up, one thread:

  fused    plain autograd: F, then B (input and weight gradients together)
  split    the 2BP engine: F, I, then W of that micro-batch alone
  concat   the 2BP engine: F and I of every micro-batch, then ONE W over all

Prints per micro-batch milliseconds (minimum and median over the repeats) of
each part, and the ratios that decide whether 2BP can pay off: the engine's
forward against the plain forward, I + W against B, and the concatenated W
against m single ones.

    .venv/bin/python benchmarks/pipeline/block_backward.py [--regime large|small] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import Tensor, nn

from twobp.engine import WeightGradStore, defer_weight_grads
from twobp.models import build_model
from twobp_bench.config import REGIMES


def decoder_block(regime: str) -> tuple[nn.Module, int, int, int]:
    """A fresh decoder block of ``regime``, with its micro-batch size, length and width."""
    r = REGIMES[regime]
    overrides = {**r.overrides, "n_layers": 1}
    spec = build_model("llama", "tiny", seed=0, **overrides)
    return spec.blocks[1], r.microbatch_size, int(overrides["seq_len"]), int(overrides["dim"])


def run_fused(block: nn.Module, xs: list[Tensor], gs: list[Tensor]) -> dict[str, float]:
    f = b = 0.0
    for x, g in zip(xs, gs, strict=True):
        leaf = x.detach().requires_grad_()
        t0 = time.perf_counter()
        out = block(leaf)
        t1 = time.perf_counter()
        torch.autograd.backward([out], [g])
        f, b = f + t1 - t0, b + time.perf_counter() - t1
    block.zero_grad(set_to_none=True)
    return {"F": f, "B": b}


def run_split(
    block: nn.Module, store: WeightGradStore, xs: list[Tensor], gs: list[Tensor], concat: bool
) -> dict[str, float]:
    f = i = w = 0.0
    for mb, (x, g) in enumerate(zip(xs, gs, strict=True)):
        leaf = x.detach().requires_grad_()
        t0 = time.perf_counter()
        with store.forward(mb):
            out = block(leaf)
        t1 = time.perf_counter()
        store.backward_input(mb, [out], [g], [leaf])
        t2 = time.perf_counter()
        if not concat:
            store.backward_weight([mb])
        f, i, w = f + t1 - t0, i + t2 - t1, w + time.perf_counter() - t2
    if concat:
        t0 = time.perf_counter()
        store.backward_weight(range(len(xs)))
        w += time.perf_counter() - t0
    store.finish_step()
    block.zero_grad(set_to_none=True)
    return {"F": f, "I": i, "W": w}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default=None)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for regime in [args.regime] if args.regime else sorted(REGIMES):
        fused_block, rows, seq, dim = decoder_block(regime)
        split_block, _, _, _ = decoder_block(regime)
        concat_block, _, _, _ = decoder_block(regime)
        split_store = defer_weight_grads(split_block)
        concat_store = defer_weight_grads(concat_block)
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(rows, seq, dim, generator=gen) for _ in range(args.microbatches)]
        gs = [torch.randn(rows, seq, dim, generator=gen) for _ in range(args.microbatches)]
        samples: dict[str, list[float]] = {}
        for rep in range(args.warmup + args.repeats):
            parts = {
                **{f"fused {k}": v for k, v in run_fused(fused_block, xs, gs).items()},
                **{
                    f"split {k}": v
                    for k, v in run_split(split_block, split_store, xs, gs, False).items()
                },
                "concat W": run_split(concat_block, concat_store, xs, gs, True)["W"],
            }
            if rep >= args.warmup:
                for key, value in parts.items():
                    samples.setdefault(key, []).append(1e3 * value / args.microbatches)
        low = {k: min(v) for k, v in samples.items()}
        mid = {k: statistics.median(v) for k, v in samples.items()}
        print(f"{regime}: {rows * seq} rows per GEMM, dim {dim}, m = {args.microbatches}")
        for key in samples:
            print(f"  {key:10s} {low[key]:7.2f} ms (median {mid[key]:.2f}) per micro-batch")
        two_bp = low["split F"] + low["split I"] + low["concat W"]
        split_backward = low["split I"] + low["split W"]
        print(
            f"  engine F / plain F        {low['split F'] / low['fused F']:.2f}\n"
            f"  (I + W) / B               {split_backward / low['fused B']:.2f}\n"
            f"  concat W / m single W     {low['concat W'] / low['split W']:.2f}\n"
            f"  2BP F+I+W(concat) / F+B   {two_bp / (low['fused F'] + low['fused B']):.2f}"
        )


if __name__ == "__main__":
    main()
