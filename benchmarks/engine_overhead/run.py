"""The engine's own cost per layer call: F, I and W of small layers, against plain autograd.

A stage runs one micro-batch at a time, the engine's way (F in
``store.forward``, then I, then W) and plain autograd's (forward, then one
backward), interleaved after a warm-up. The layers are small enough that the
kernels cost little: what remains is the per-call overhead of the engine.
``--stage linear`` is a stack of ``nn.Linear`` (figures per Linear call),
``--stage layernorm`` one of ``nn.LayerNorm`` (per LayerNorm call);
``--stage llama`` a stack of twobp's LLaMA-like decoder blocks and
``--stage gpt2`` one of transformers' GPT-2 blocks, without dropout (figures
per block: attention, norms and activations pass through the engine's capture
too). One thread, timed by its CPU time (``time.thread_time``): other
processes on a shared machine then weigh less on the figures than on wall time.

    python benchmarks/engine_overhead/run.py                 # this checkout
    python benchmarks/engine_overhead/run.py --baseline REV  # and git revision REV, alternated
    python benchmarks/engine_overhead/run.py --in-a-row 10   # each way 10 steps in a row

With ``--baseline`` each round runs a process of REV's twobp and one of this
checkout's, in turn, and the medians over rounds are printed side by side:
the machine's load then weighs on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _stage(kind: str, width: int, layers: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if kind == "layernorm":
        return nn.Sequential(*[nn.LayerNorm(width) for _ in range(layers)])
    if kind == "gpt2":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        gpt2 = GPT2Config(
            n_embd=width, n_head=4, n_layer=layers, n_positions=16, attn_implementation="eager"
        )
        gpt2.resid_pdrop = gpt2.embd_pdrop = gpt2.attn_pdrop = 0.0
        return nn.Sequential(*[GPT2Block(gpt2, layer_idx=i) for i in range(layers)])
    from twobp.models.llama import DecoderBlock, LlamaConfig

    config = LlamaConfig(
        vocab_size=32, dim=width, n_layers=layers, n_heads=4, ffn_dim=2 * width, seq_len=16
    )
    return nn.Sequential(*[DecoderBlock(config) for _ in range(layers)])


def measure(
    kind: str, width: int, layers: int, rows: int, reps: int, in_a_row: int = 1
) -> dict[str, float]:
    """Microseconds per layer call: plain forward and backward, and the engine's F, I, W.

    ``in_a_row``: steps each way runs before the other runs as many (1: they alternate step by
    step). What ran just before a forward sets what is still in cache: plain autograd's
    backward, which allocates a fresh weight gradient per layer, leaves less of the engine's
    next F in cache than the engine's own W does, and at large widths alternating step by step
    charges the engine's F for it (see docs/performance.md).
    """
    import torch

    from twobp.engine import defer_weight_grads

    torch.set_num_threads(1)
    clock = time.thread_time
    plain = _stage(kind, width, layers)
    split = _stage(kind, width, layers)
    store = defer_weight_grads(split)
    shape = (rows, width) if kind in ("linear", "layernorm") else (rows, 16, width)
    x = torch.randn(*shape)
    dy = torch.randn(*shape)
    times: dict[str, list[float]] = {"plain F": [], "plain B": [], "F": [], "I": [], "W": []}

    def plain_step(record: bool) -> None:
        t0 = clock()
        y = plain(x.requires_grad_())
        t1 = clock()
        y.backward(dy)
        t2 = clock()
        x.grad = None
        if record:
            times["plain F"].append(t1 - t0)
            times["plain B"].append(t2 - t1)

    def engine_step(record: bool) -> None:
        leaf = x.detach().requires_grad_()
        t0 = clock()
        with store.forward(0):
            y = split(leaf)
        t1 = clock()
        store.backward_input(0, [y], [dy], [leaf])
        t2 = clock()
        store.backward_weight([0])
        t3 = clock()
        store.finish_step()
        if record:
            for key, t in zip(("F", "I", "W"), (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[key].append(t)

    warmup = reps // 5
    for rep in range(0, reps + warmup, in_a_row):
        for step in (plain_step, engine_step):
            for i in range(rep, min(rep + in_a_row, reps + warmup)):
                # The first of each run in a row follows the other way's step: left out
                # unless the two alternate step by step.
                step(i >= warmup and (in_a_row == 1 or i > rep))
    return {k: 1e6 * statistics.median(v) / layers for k, v in times.items()}


def _child(args: argparse.Namespace) -> None:
    print(
        json.dumps(
            measure(args.stage, args.width, args.layers, args.rows, args.reps, args.in_a_row)
        )
    )


def _run(src: Path, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", "--stage", args.stage, "--width", str(args.width)]
    cmd += ["--layers", str(args.layers), "--rows", str(args.rows), "--reps", str(args.reps)]
    cmd += ["--in-a-row", str(args.in_a_row)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stage", choices=["linear", "layernorm", "llama", "gpt2"], default="linear"
    )
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--in-a-row",
        type=int,
        default=1,
        help="steps each way runs before the other does (1: alternate step by step)",
    )
    parser.add_argument("--baseline", help="a git revision to measure alternately with this one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this checkout": ROOT / "src"}
        if args.baseline:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline, "src"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            sources = {args.baseline: Path(tmp) / "src", **sources}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
        for _ in range(args.rounds):
            for name, src in sources.items():
                rounds[name].append(_run(src, args))
    stage = {
        "linear": f"Linear({args.width}, {args.width})",
        "layernorm": f"LayerNorm({args.width})",
        "llama": "LLaMA block",
        "gpt2": "GPT-2 block",
    }[args.stage]
    print(
        f"{args.layers} x {stage} (width {args.width}), {args.rows} rows, 1 thread; us per layer "
        f"call, medians of {args.reps} reps ({args.in_a_row} in a row), median over "
        f"{args.rounds} rounds"
    )
    print("| twobp | plain F | F | F - plain F | plain B | I | W | I + W | I + W - plain B |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, results in rounds.items():
        m = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(
            f"| {name} | {m['plain F']:.1f} | {m['F']:.1f} | {m['F'] - m['plain F']:.1f} "
            f"| {m['plain B']:.1f} | {m['I']:.1f} | {m['W']:.1f} | {m['I'] + m['W']:.1f} "
            f"| {m['I'] + m['W'] - m['plain B']:.1f} |"
        )


if __name__ == "__main__":
    main()
