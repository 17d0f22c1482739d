"""``twobp profile``: measure a reference model's blocks, split them, write a cost profile.

The profile is the simulator's cost JSON (:mod:`twobp.sim.cost_io`), which
``twobp simulate --costs-file`` and ``twobp plan --costs-file`` read.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from twobp.cli.errors import UsageError, check_at_least
from twobp.config import add_arguments, check_writable, doc, from_namespace, parse_overrides


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
    set: str | None = doc(
        "config fields of the --size preset to change, e.g. 'dim=256,n_layers=4,seq_len=64'",
        None,
    )
    hardware_out: str | None = doc(
        "llama only: also write this machine as a device JSON for `twobp plan --gpu FILE`, "
        "its rates fitted to the decoder layers just measured (at this micro-batch's shapes)",
        None,
    )


PROFILE_BYTES_PER_PARAMETER = 2
"""What profiling holds per parameter, in parameter-sized tensors: the weights and
the gradients every block's backward leaves on them (activations come on top)."""


def available_memory() -> float | None:
    """Bytes this machine can still give (Linux ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(name: str, parameters: int, dtype_bytes: int, available: float | None) -> None:
    """Refuse, before building it, a model whose profile cannot fit this machine.

    Raises:
        UsageError: naming the bytes it would need, those there are, and the
            analytic plan that needs no model built.
    """
    needed = float(parameters * dtype_bytes * PROFILE_BYTES_PER_PARAMETER)
    if available is None or needed <= available:
        return
    family, _, size = name.partition("-")
    from twobp.sim.analytic.shapes import PRESETS

    instead = (
        f"plan it from its shapes instead: twobp plan --model {family} --size {size} "
        "--gpus N --gpu KIND"
        if size in PRESETS.get(family, {})
        else "plan it from costs instead: twobp plan --costs F=...,I=...,W=...,act=...,param=..."
    )
    raise UsageError(
        f"--model {family} --size {size}: profiling needs at least "
        f"{needed / 1e9:.1f} GB ({parameters / 1e9:.2f}B parameters, weights and gradients) "
        f"and this machine has {available / 1e9:.1f} GB available; profile it on a device "
        f"that holds it, or {instead}"
    )


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
    if cfg.hardware_out is not None and cfg.model != "llama":
        raise UsageError(
            f"--hardware-out: fitted to LLaMA decoder layers; --model {cfg.model} has none"
        )
    if cfg.hardware_out is not None and cfg.dtype == "float64":
        raise UsageError("--hardware-out: a device's rates are bfloat16 or float32, not float64")
    try:
        check_writable("--out", cfg.out, folder=False)
        if cfg.hardware_out is not None:
            check_writable("--hardware-out", cfg.hardware_out, folder=False)
        changes = parse_overrides(cfg.set or "", "--set")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    dtype = DTYPES[cfg.dtype]
    try:
        # Shapes first, on the meta device (nothing allocated): the model may not fit.
        shapes = build_model(cfg.model, cfg.size, dtype=dtype, device="meta", **changes)
    except (ValueError, TypeError) as exc:
        given = f"--size {cfg.size}" + (f" --set {cfg.set}" if cfg.set else "")
        raise UsageError(f"{given}: {exc}") from exc
    parameters = sum(p.numel() for block in shapes.blocks for p in block.parameters())
    element = torch.empty((), dtype=dtype).element_size()
    check_fits(f"{cfg.model}-{cfg.size}", parameters, element, available_memory())
    spec = build_model(cfg.model, cfg.size, dtype=dtype, **changes)
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
    if cfg.hardware_out is not None:
        write_device(cfg, spec, costs, model, plan.sizes, changes)
    return 0


def write_device(
    cfg: ProfileConfig,
    spec: Any,
    costs: Any,
    model: Any,
    sizes: Sequence[int],
    changes: Mapping[str, Any],
) -> None:
    """Fit this machine's rates to the profiled decoder layers and write its device JSON,
    with the slowdown a pipeline of ``sizes`` (one stage per local rank) runs at."""
    spec_dtype = next(spec.blocks[0].parameters()).dtype
    from twobp.models.spec import BlockKind
    from twobp.sim.analytic import HARDWARE
    from twobp.sim.analytic.calibrate import fit_hardware
    from twobp.sim.analytic.hardware import save_hardware
    from twobp.sim.analytic.shapes import DecoderShape, block_costs

    config = spec.config
    shape = DecoderShape(
        f"{cfg.model}-{cfg.size}",
        config.n_layers,
        config.dim,
        config.n_heads,
        config.ffn_dim,
        config.vocab_size,
    )
    block = block_costs(shape, config.seq_len, cfg.microbatch_size, cfg.dtype)
    layers = [
        (c.forward, c.backward_input, c.backward_weight)
        for c, kind in zip(costs, spec.block_kinds, strict=True)
        if kind is BlockKind.BODY
    ]
    contention = 1.0
    if cfg.stages > 1 and next(spec.blocks[0].parameters()).device.type == "cpu":
        from twobp.cli.pipeline_rate import pipeline_slowdown

        profiled = [
            f + i + w
            for f, i, w in zip(
                model.forward, model.backward_input, model.backward_weight, strict=True
            )
        ]
        contention = pipeline_slowdown(
            cfg.model,
            cfg.size,
            changes,
            spec_dtype,
            cfg.microbatch_size,
            sizes,
            profiled,
            threads=cfg.threads,
        )
    device = fit_hardware(
        replace(HARDWARE["cpu"], contention=contention),
        block,
        layers,
        name="cpu",
        source=(
            f"fitted by twobp profile to {len(layers)} layers of {shape.name} "
            f"(dim {config.dim}, {cfg.microbatch_size} x {config.seq_len} tokens), "
            f"{cfg.threads} thread(s), {cfg.dtype}"
        ),
    )
    save_hardware(device, cfg.hardware_out or "")
    efficiency = device.efficiency["attention"]
    print(
        f"wrote {cfg.hardware_out}: weight matrices at {device.peak_fp32 / 1e9:.3g} GFLOP/s, "
        f"attention and the rest at {efficiency:.3g} of that, {contention:.3g}x slower in a "
        f"{cfg.stages}-rank pipeline; use it with `twobp plan --gpu {cfg.hardware_out}`"
    )
