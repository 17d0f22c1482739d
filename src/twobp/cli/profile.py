"""``twobp profile``: measure a reference model's blocks, split them, write a cost profile.

The profile is the simulator's cost JSON (:mod:`twobp.sim.cost_io`), which
``twobp simulate --costs-file`` and ``twobp plan --costs-file`` read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from twobp.cli.errors import UsageError, check_at_least
from twobp.config import add_arguments, check_writable, doc, from_namespace


@dataclass
class ProfileConfig:
    """Options of ``twobp profile``."""

    model: str = doc("model family", "llama", choices=("llama", "bert", "mamba", "resnet"))
    size: str = doc("model size preset", "tiny")
    microbatch_size: int = doc("samples per micro-batch to profile with", 4)
    stages: int = doc("stages to split the blocks into", 2)
    memory_limit: float | None = doc(
        "most bytes a stage may hold for its blocks (activations of one micro-batch and "
        "parameters); default: no limit",
        None,
    )
    repeats: int = doc("timed repetitions per block (the median is kept)", 5)
    dtype: str = doc("dtype of the model", "float32", choices=("float32", "float64", "bfloat16"))
    threads: int = doc("torch threads while profiling", 1)
    out: str = doc("where to write the cost profile JSON", "profile.json")


def register(subparsers: Any) -> None:
    """Add the ``profile`` sub-command."""
    parser = subparsers.add_parser(
        "profile",
        help="measure per-block F/I/W costs, pick a balanced partition, write a cost profile",
        description=(
            "Profile every block of a reference model on this machine (forward, backward-p1, "
            "backward-p2, bytes kept for backward), solve the balanced partition and write the "
            "per-stage cost profile that `twobp simulate` and `twobp plan` accept."
        ),
    )
    add_arguments(parser, ProfileConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    from twobp.models import build_model
    from twobp.partition import solve
    from twobp.partition.profiler import profile_blocks, solver_costs
    from twobp.sim import save_costs
    from twobp.sim.from_profile import stage_cost_model
    from twobp.train.task import DTYPES

    cfg = from_namespace(ProfileConfig, args)
    check_at_least(
        microbatch_size=(cfg.microbatch_size, 1),
        stages=(cfg.stages, 1),
        repeats=(cfg.repeats, 1),
        threads=(cfg.threads, 1),
    )
    if cfg.memory_limit is not None and not cfg.memory_limit > 0:
        raise UsageError(f"--memory-limit must be > 0 bytes, got {cfg.memory_limit}")
    try:
        check_writable("--out", cfg.out, folder=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    try:
        spec = build_model(cfg.model, cfg.size, dtype=DTYPES[cfg.dtype])
    except ValueError as exc:
        raise UsageError(f"--size {cfg.size}: {exc}") from exc
    if cfg.stages > spec.n_blocks:
        raise UsageError(
            f"--stages {cfg.stages}: {cfg.model}-{cfg.size} has {spec.n_blocks} blocks, and "
            f"each stage needs one; give at most {spec.n_blocks} stages"
        )
    torch.set_num_threads(cfg.threads)
    costs = profile_blocks(
        spec.blocks, spec.example_input(cfg.microbatch_size), repeats=cfg.repeats
    )
    memory = [float(c.activation_bytes + c.parameter_bytes) for c in costs]
    try:
        plan = solve(
            solver_costs(costs),
            cfg.stages,
            memory=memory if cfg.memory_limit is not None else None,
            memory_limit=cfg.memory_limit,
        )
    except ValueError as exc:
        raise UsageError(f"--memory-limit {cfg.memory_limit:g}: {exc}") from exc
    print(f"{cfg.model}-{cfg.size}, micro-batch {cfg.microbatch_size}, {cfg.threads} thread(s)")
    print(f"{'block':>5}  {'name':<24} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'act KiB':>9}")
    for c in costs:
        print(
            f"{c.index:>5}  {c.name[:24]:<24} {c.forward * 1e3:8.3f} {c.backward_input * 1e3:8.3f}"
            f" {c.backward_weight * 1e3:8.3f} {c.activation_bytes / 1024:9.1f}"
        )
    print(
        f"balanced partition over {cfg.stages} stages: {plan.sizes} "
        f"(slowest stage F+I+W {plan.bottleneck * 1e3:.3f} ms; "
        f"stages {', '.join(f'{t * 1e3:.3f}' for t in plan.stage_costs)} ms)"
    )
    model = stage_cost_model(
        costs,
        plan.sizes,
        meta={"model": f"{cfg.model}-{cfg.size}", "microbatch_size": cfg.microbatch_size},
    )
    save_costs(model, cfg.out)
    print(f"wrote {cfg.out}: use it with `twobp simulate --costs-file {cfg.out}` or `twobp plan`")
    return 0
