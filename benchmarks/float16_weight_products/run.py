"""The 2BP engine's W of float16 stashes: a float16 product against the float32 one it runs.

A concatenated W of ``m`` micro-batches sums their products in one matrix
product. In float16 that sum can overflow (65504) where each micro-batch's
would not, so the engine's W products of float16 stashes return float32
(:mod:`twobp.engine.precision`: on CUDA a float16 product with a float32
output, elsewhere the operands cast up). This prints, for a few shapes of
``cat(dY)^T @ cat(X)``, the time of the float16 product and of the float32
one (cast included), interleaved over rounds (medians, one thread), and the
largest value each returns for operands whose per-micro-batch product is
about 30000: the float16 one overflows to inf, the float32 one does not.

    python benchmarks/float16_weight_products/run.py [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from twobp.engine.precision import weight_mm

SHAPES = [(256, 256, 256), (1024, 512, 512)]
"""(rows of the concatenation, in features, out features)."""


def _time(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(f"{'rows x in x out':>20} {'float16 s':>11} {'float32 out s':>14} {'ratio':>6}  max")
    for rows, k, n in SHAPES:
        dy = torch.randn(rows, n, device=device).half()
        x = torch.randn(rows, k, device=device).half()

        def half(dy=dy, x=x):
            return torch.mm(dy.t(), x)

        def wide(dy=dy, x=x):
            return weight_mm(dy.t(), x)

        half(), wide()
        times: dict[str, list[float]] = {"half": [], "wide": []}
        for _ in range(args.rounds):
            times["half"].append(_time(half, device))
            times["wide"].append(_time(wide, device))
        a, b = statistics.median(times["half"]), statistics.median(times["wide"])
        # Four micro-batches whose products are about 30000 each.
        big_dy = torch.full((4, n), 120.0, device=device).half()
        big_x = torch.full((4, k), 250.0, device=device).half()
        peaks = (
            float(torch.mm(big_dy.t(), big_x).max()),
            float(weight_mm(big_dy.t(), big_x).max()),
        )
        print(
            f"{f'{rows} x {k} x {n}':>20} {a:>11.5f} {b:>14.5f} {a / b:>6.1f}  "
            f"{peaks[0]:g} / {peaks[1]:g}"
        )


if __name__ == "__main__":
    main()
