"""LLaMA-7B on P = 4 pipeline ranks x D = 8 copies, simulated: parameters sharded or not.

Analytic costs (``twobp.sim.analytic``, H100 by default), bf16 weights with fp32 AdamW
state and masters, 4096 tokens a sequence, micro-batches of one sequence. For the layout
with the optimizer state sharded over the copies (``pipe.shard_optimizer``) and with the
parameters, gradients and optimizer state sharded (``shard_parameters=True``): the
schedule, the memory per rank (what it keeps between steps, and what the step holds at
its peak: activations and stashes, and with sharded parameters a stage's gathered
weights and whole gradients), the step time, and the gradient reduce-scatters and weight
all-gather: their time on the link and how much later the step ends for them (overlap
hides the rest). Sharded, twice: the gradients reduce-scattered once at each stage's
``R`` (the default) and after each ``W`` or ``B`` (``scatter_each_w=True``). Three
cases: 512 sequences a step (64 micro-batches a copy), the best schedule of ``twobp
plan``'s search; 64 sequences (8 micro-batches), 1F1B with 2BP ``paper`` (every ``W``
after the stage's last ``I``), and 1F1B with 2BP ``eager`` (every ``W`` right after its
``I``). Prints a markdown table.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_parameters/llama_7b.py [--gpu h100]
"""

from __future__ import annotations

import argparse

from twobp.sim.analytic import compare_sharding, decoder_shape, load_hardware
from twobp.sim.analytic.layout import STEP_SHARDED, STEP_WHOLE

GIB = 2.0**30
CASES = (
    (64, None),
    (8, (("1f1b",), ("paper",), ("off",))),
    (8, (("1f1b",), ("eager",), ("off",))),
)
"""Micro-batches a copy, and the schedules, policies and recompute modes searched (None:
those of ``twobp plan``)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    shape, device = decoder_shape("llama", "7b"), load_hardware(args.gpu)
    pipeline, data, seq_len = 4, 8, 4096
    print(f"{shape.name}, P={pipeline} D={data}, micro-batches of 1 sequence, {device.name}")
    print(
        "| m | parameters | gradients reduce-scattered | schedule | weights | gradients "
        "| optimizer | the step's | peak per rank | step | collectives | exposed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, tried in CASES:
        dims = (pipeline, data, 1, 1, m, seq_len)
        for row in compare_sharding(shape, device, dims, tried=tried):
            layout, c = row.layout, row.layout.candidate
            memory = layout.memory
            step_part = STEP_SHARDED if layout.shard_parameters else STEP_WHOLE
            policy = "" if c.policy == "off" else f" ({c.policy})"
            cells = [
                str(m),
                "sharded" if layout.shard_parameters else "whole",
                ("after each W" if row.scatter_each_w else "at R")
                if layout.shard_parameters
                else "(all-reduced at R)",
                f"{c.schedule}{policy}",
                *(f"{memory[k] / GIB:.2f} GiB" for k in ("weights", "gradients", "optimizer")),
                f"{memory[step_part] / GIB:.2f} GiB",
                f"{row.peak / GIB:.1f} GiB",
                f"{layout.step:.3f} s",
                f"{row.collectives:.3f} s ({row.collectives / layout.step:.1%})",
                f"{row.exposed * 1e3:.1f} ms ({row.exposed / layout.step:.2%})",
            ]
            print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
