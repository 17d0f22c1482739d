"""Cost of splitting the backward in two, and gain of concatenating W.

A stack of linear layers (one pipeline stage) runs the backward of several
micro-batches in three ways, interleaved (A B C A B C ...) after a warm-up:

  A  fused    plain autograd backward per micro-batch (I and W together)
  B  split    per micro-batch: backward_input, then backward_weight of it alone
  C  concat   backward_input of every micro-batch, then ONE backward_weight
              over all of them (dW = cat(dY)^T @ cat(X) per layer)

Forwards are not timed. Prints medians in milliseconds for all micro-batches
of a step, and the ratios. One thread, float32.

    .venv/bin/python benchmarks/backward_split/run.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from twobp.engine import WeightGradStore, defer_weight_grads

Timings = dict[str, float]


def make_stage(width: int, layers: int) -> nn.Sequential:
    """The same stack of linear layers on every call."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def clear_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def forward_all(
    module: nn.Module, xs: list[Tensor], store: WeightGradStore | None
) -> tuple[list[Tensor], list[Tensor]]:
    inputs = [x.detach().requires_grad_() for x in xs]
    outputs = []
    for mb, x in enumerate(inputs):
        if store is None:
            outputs.append(module(x))
        else:
            with store.forward(mb):
                outputs.append(module(x))
    return inputs, outputs


def run_fused(module: nn.Module, xs: list[Tensor], dys: list[Tensor]) -> Timings:
    _, outs = forward_all(module, xs, None)
    start = time.perf_counter()
    for out, dy in zip(outs, dys, strict=True):
        torch.autograd.backward([out], [dy])
    return {"total": time.perf_counter() - start}


def run_split(
    module: nn.Module, store: WeightGradStore, xs: list[Tensor], dys: list[Tensor]
) -> Timings:
    inputs, outs = forward_all(module, xs, store)
    t_input = t_weight = 0.0
    for mb, (x, out, dy) in enumerate(zip(inputs, outs, dys, strict=True)):
        t0 = time.perf_counter()
        store.backward_input(mb, [out], [dy], [x])
        t1 = time.perf_counter()
        store.backward_weight([mb])
        t_input += t1 - t0
        t_weight += time.perf_counter() - t1
    store.finish_step()
    return {"total": t_input + t_weight, "I": t_input, "W": t_weight}


def run_concat(
    module: nn.Module, store: WeightGradStore, xs: list[Tensor], dys: list[Tensor]
) -> Timings:
    inputs, outs = forward_all(module, xs, store)
    t0 = time.perf_counter()
    for mb, (x, out, dy) in enumerate(zip(inputs, outs, dys, strict=True)):
        store.backward_input(mb, [out], [dy], [x])
    t1 = time.perf_counter()
    store.backward_weight(range(len(xs)))
    t2 = time.perf_counter()
    store.finish_step()
    return {"total": t2 - t0, "I": t1 - t0, "W": t2 - t1}


def check_same_gradients(
    runs: dict[str, Callable[[], Timings]], modules: dict[str, nn.Module]
) -> None:
    """All variants must compute the same gradients before their times mean anything."""
    grads = {}
    for name, run in runs.items():
        clear_grads(modules[name])
        run()
        grads[name] = [p.grad.clone() for p in modules[name].parameters()]
    for name, g in grads.items():
        for a, b in zip(g, grads["fused"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{name} vs fused")


def bench_size(args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Median times (ms) of every variant for micro-batches of ``batch`` rows."""
    fused_module = make_stage(args.width, args.layers)
    split_module = make_stage(args.width, args.layers)
    concat_module = make_stage(args.width, args.layers)
    split_store = defer_weight_grads(split_module)
    concat_store = defer_weight_grads(concat_module)
    g = torch.Generator().manual_seed(batch)
    xs = [torch.randn(batch, args.width, generator=g) for _ in range(args.microbatches)]
    dys = [torch.randn(batch, args.width, generator=g) for _ in range(args.microbatches)]
    runs: dict[str, Callable[[], Timings]] = {
        "fused": lambda: run_fused(fused_module, xs, dys),
        "split": lambda: run_split(split_module, split_store, xs, dys),
        "concat": lambda: run_concat(concat_module, concat_store, xs, dys),
    }
    modules = {"fused": fused_module, "split": split_module, "concat": concat_module}
    check_same_gradients(runs, modules)

    samples: dict[str, list[Timings]] = {name: [] for name in runs}
    for rep in range(args.warmup + args.reps):
        for name, run in runs.items():
            clear_grads(modules[name])
            timings = run()
            if rep >= args.warmup:
                samples[name].append(timings)

    def median(name: str, key: str = "total") -> float:
        return 1e3 * statistics.median(t[key] for t in samples[name])

    return {
        "fused": median("fused"),
        "split": median("split"),
        "concat": median("concat"),
        "split_I": median("split", "I"),
        "split_W": median("split", "W"),
        "concat_I": median("concat", "I"),
        "concat_W": median("concat", "W"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64]
    )
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    n = args.microbatches
    print(
        f"{args.layers} x Linear({args.width}, {args.width}), {n} micro-batches, float32, "
        f"1 thread, median of {args.reps} interleaved runs; times in ms for the backward "
        f"of all {n} micro-batches"
    )
    header = (
        "| mb size | fused B | split I+W | split/fused | I + 1 concat W | concat/fused "
        f"| W: {n} separate | W: 1 concat | concat W/separate W |"
    )
    print(header)
    print("|" + "|".join(["---"] * 9) + "|")
    for batch in args.sizes:
        r = bench_size(args, batch)
        print(
            f"| {batch} | {r['fused']:.2f} | {r['split']:.2f} | {r['split'] / r['fused']:.3f} "
            f"| {r['concat']:.2f} | {r['concat'] / r['fused']:.3f} "
            f"| {r['split_W']:.2f} | {r['concat_W']:.2f} | {r['concat_W'] / r['split_W']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
