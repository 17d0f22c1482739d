"""What overlapping the gradient reduction with the remaining W buys, in the simulator.

A pipeline of P ranks runs D copies side by side; every stage all-reduces its
weight gradients over its D copies (2D under Chimera) once per step. twobp
starts that all-reduce (the ``R`` action) in the background as soon as the
stage's last ``W`` is done, so it overlaps the W and I work still running on
the rank; without that, it starts after the rank's last action. This script
simulates both for a paper-size model and prints the step times.

The default cost model is LLaMA-7B's layers written out, not measured: 32
decoder layers (hidden 4096, MLP 11008, 202M parameters each), micro-batches
of 1 x 2048 tokens, 8 layers per stage, bf16 gradients, a GPU sustaining
``--tflops`` on these GEMMs (F = I = W, each about 2 x parameters x tokens
FLOP), and ``--bandwidth`` GB/s between nodes for the all-reduce (ring).

A second table shards the optimizer state over the D copies
(``Pipeline.shard_optimizer``, ZeRO-1): ``R`` reduce-scatters the gradients
(half the all-reduce's time) and the updated parameters are all-gathered
in the order of the stages' first F of the next step; that F runs each layer
once the layer's parameters are there (the runtime waits block by block), so
the first stage of the first rank waits for the part of its gather that its
first F does not cover. Memory per rank: bf16 weights and gradients (4 bytes a
parameter), AdamW's state in float32 with float32 master weights (12 bytes a
parameter, 1/D of it sharded), and the activations (34 bytes a token and
hidden unit of a layer, bf16, no recomputation) and 2BP stash (taken as half
of that) as the simulator holds them.

    python benchmarks/reduction_overlap/run.py
    python benchmarks/reduction_overlap/run.py --ranks 4 --copies 8 --microbatches 16
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from twobp.schedule import generate
from twobp.schedule.two_bp import apply_two_bp
from twobp.sim import simulate
from twobp.sim.costs import CostModel
from twobp.sim.reduction import reductions_at_end, with_reductions

LAYER_PARAMETERS = 4 * 4096**2 + 3 * 4096 * 11008
"""Weights of one LLaMA-7B decoder layer (attention and MLP; norms are negligible)."""


def paper_costs(ranks: int, tokens: int, tflops: float, bandwidth_gbs: float) -> CostModel:
    """Per-stage costs of LLaMA-7B's 32 layers cut into ``ranks`` stages."""
    layers = 32 // ranks
    flop = 2 * LAYER_PARAMETERS * tokens * layers  # one of F, I or W
    seconds = flop / (tflops * 1e12)
    return CostModel.uniform(
        ranks,
        f=seconds,
        i=seconds,
        w=seconds,
        send_latency=10e-6,
        bandwidth=bandwidth_gbs * 1e9,
        send_bytes=2 * tokens * 4096,
        parameter_bytes=2 * LAYER_PARAMETERS * layers,  # bf16 gradients
        optimizer_bytes=12 * LAYER_PARAMETERS * layers,  # AdamW m, v and master, float32
        activation_bytes=34 * tokens * 4096 * layers,
        weight_grad_bytes=17 * tokens * 4096 * layers,
    )


def held(costs: CostModel) -> CostModel:
    """The costs with the bf16 weights counted beside the gradients (the memory model)."""
    assert costs.parameter_bytes is not None
    return replace(costs, parameter_bytes=tuple(2 * b for b in costs.parameter_bytes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks P")
    parser.add_argument("--copies", type=int, default=8, help="data-parallel copies D")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per copy")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s")
    parser.add_argument("--bandwidth", type=float, default=50.0, help="GB/s between nodes")
    args = parser.parse_args()
    costs = paper_costs(args.ranks, args.tokens, args.tflops, args.bandwidth)
    reduce_ms = 1e3 * costs.with_reduction(args.copies, costs.parameter_bytes or ()).reduce[0]
    print(
        f"LLaMA-7B layers, P = {args.ranks}, D = {args.copies}, m = {args.microbatches}: "
        f"F = I = W = {1e3 * costs.forward[0]:.1f} ms per stage, all-reduce of a stage's "
        f"gradients over {args.copies} copies {reduce_ms:.0f} ms"
    )
    print()
    print("| schedule | 2BP | step, R after last W (ms) | step, R at the end (ms) | gain |")
    print("|---|---|---:|---:|---:|")
    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "chimera"):
        for policy in (None, "paper"):
            if name in ("zb-h1", "zb-v") and policy is None:
                continue  # natively split
            schedule = generate(name, args.ranks, args.microbatches)
            if policy is not None:
                schedule = apply_two_bp(schedule, policy)
            fitted = costs.for_schedule(schedule.n_stages, schedule.n_pipelines)
            replicated, timed = with_reductions(schedule, fitted, args.copies)
            overlapped = simulate(replicated, timed).makespan
            at_end = simulate(reductions_at_end(replicated), timed).makespan
            print(
                f"| {name} | {policy or 'off'} | {1e3 * overlapped:.0f} | {1e3 * at_end:.0f} "
                f"| {at_end / overlapped:.3f}x |"
            )
    print()
    print(
        f"Optimizer state sharded over the {args.copies} copies (ZeRO-1): step and memory "
        "per rank (largest rank)"
    )
    print()
    print(
        "| schedule | 2BP | step (ms) | step, sharded (ms) | of it, gather wait (ms) "
        "| gather wait / step | sharded / unsharded step | memory (GB) | memory, sharded (GB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "chimera"):
        for policy in (None, "paper"):
            if name in ("zb-h1", "zb-v") and policy is None:
                continue
            schedule = generate(name, args.ranks, args.microbatches)
            if policy is not None:
                schedule = apply_two_bp(schedule, policy)
            fitted = costs.for_schedule(schedule.n_stages, schedule.n_pipelines)
            # A stage's first F waits for each layer's parameters before that layer runs.
            layers = 32 * schedule.n_pipelines // schedule.n_stages
            figures = []
            for shard in (False, True):
                replicated, timed = with_reductions(
                    schedule,
                    replace(fitted, shard_optimizer=shard, gather_pieces=layers),
                    args.copies,
                )
                figures.append(simulate(replicated, held(timed)))
            plain, sharded = figures
            print(
                f"| {name} | {policy or 'off'} | {1e3 * plain.makespan:.0f} "
                f"| {1e3 * sharded.makespan:.0f} | {1e3 * sharded.gather_wait:.0f} "
                f"| {sharded.gather_wait / sharded.makespan:.1%} "
                f"| {sharded.makespan / plain.makespan:.3f} "
                f"| {max(plain.peak_memory) / 1e9:.1f} | {max(sharded.peak_memory) / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
