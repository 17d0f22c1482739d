"""Simulated LLaMA steps on 8-64 GPUs: the best layout with 2BP and without.

For each model and cluster, the analytic planner (``twobp.sim.analytic``)
searches every layout (P x D x T, micro-batch size and count) and, for each,
the schedules and 2BP policies of ``twobp plan --model``. "Without 2BP" keeps
the schedules whose backward stays fused (1F1B as generated); "with 2BP" takes
the best of the rest (1F1B with W placed by a policy, ZB-H1, ZB-V, DualPipeV,
whose backward is split by design). Prints one markdown table.

    PYTHONPATH=src .venv/bin/python benchmarks/plan_llama/run.py
"""

from __future__ import annotations

import argparse

from twobp.schedule import SCHEDULES
from twobp.sim.analytic import decoder_shape, load_hardware, plan_layouts
from twobp.sim.analytic.layout import Layout

CASES = (("7b", 8, "a100-80g"), ("7b", 32, "h100"), ("70b", 32, "h100"), ("70b", 64, "h100"))


def _split(layout: Layout) -> bool:
    c = layout.candidate
    return c.policy != "off" or SCHEDULES[c.schedule].natively_split


def _describe(layout: Layout) -> str:
    c = layout.candidate
    policy = "" if c.policy == "off" else " " + c.policy
    return (
        f"P{layout.pipeline} D{layout.data} T{layout.tensor}, {c.schedule}{policy}, "
        f"m={layout.microbatches}x{layout.microbatch}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=512)
    args = parser.parse_args()
    print("| model | GPUs | without 2BP: step s (layout) | with 2BP: step s (layout) | speed-up |")
    print("|---|---|---|---|---:|")
    for size, gpus, gpu in CASES:
        shape, device = decoder_shape("llama", size), load_hardware(gpu)
        dims = (shape, device, gpus, args.global_batch, args.seq_len)
        fused = plan_layouts(*dims, schedules=("1f1b",), policies=("off",))
        split = [x for x in plan_layouts(*dims) if _split(x)]
        if not fused or not split:
            print(f"| llama-{size} | {gpus} x {gpu} | - | - | nothing fits one side |")
            continue
        a, b = fused[0], split[0]
        print(
            f"| llama-{size} | {gpus} x {gpu} | {a.step:.3g} ({_describe(a)}) | "
            f"{b.step:.3g} ({_describe(b)}) | {a.step / b.step:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
