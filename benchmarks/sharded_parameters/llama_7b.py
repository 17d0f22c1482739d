"""LLaMA-7B on P = 4 pipeline ranks x D = 8 copies, simulated: parameters sharded or not.

Analytic costs (``twobp.sim.analytic``, H100 by default), bf16 weights with fp32 AdamW
state and masters, 4096 tokens a sequence, 512 sequences a step (64 micro-batches of one
a copy). For the layout with the optimizer state sharded over the copies
(``pipe.shard_optimizer``) and with the parameters, gradients and optimizer state
sharded (``shard_parameters=True``): the best schedule of ``twobp plan``'s search, the
memory per rank, the step time, and the gradient reduce-scatter and weight all-gather:
their time on the link and how much later the step ends for them (overlap hides the
rest). Prints one markdown table.

    PYTHONPATH=src .venv/bin/python benchmarks/sharded_parameters/llama_7b.py [--gpu h100]
"""

from __future__ import annotations

import argparse

from twobp.sim.analytic import compare_sharding, decoder_shape, load_hardware

GIB = 2.0**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--microbatch", type=int, default=1)
    args = parser.parse_args()
    shape, device = decoder_shape("llama", "7b"), load_hardware(args.gpu)
    pipeline, data, seq_len, batch = 4, 8, 4096, 512
    m = batch // (data * args.microbatch)
    rows = compare_sharding(shape, device, (pipeline, data, 1, args.microbatch, m, seq_len))
    print(
        f"{shape.name}, P={pipeline} D={data}, {m} micro-batches of {args.microbatch}, "
        f"{device.name}"
    )
    print(
        "| parameters | schedule | weights | gradients | optimizer | gathered weights "
        "| activations and stashes | peak per rank | step | collectives | exposed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        layout, c = row.layout, row.layout.candidate
        memory = layout.memory
        policy = "" if c.policy == "off" else f" ({c.policy})"
        cells = [
            "sharded" if layout.shard_parameters else "whole (optimizer sharded)",
            f"{c.schedule}{policy}",
            *(
                f"{memory.get(k, 0.0) / GIB:.2f} GiB"
                for k in (
                    "weights",
                    "gradients",
                    "optimizer",
                    "gathered weights",
                    "activations and stashes",
                )
            ),
            f"{row.peak / GIB:.1f} GiB",
            f"{layout.step:.3f} s",
            f"{row.collectives:.3f} s ({row.collectives / layout.step:.1%})",
            f"{row.exposed * 1e3:.1f} ms ({row.exposed / layout.step:.2%})",
        ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
