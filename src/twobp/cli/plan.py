"""``twobp plan``: rank every schedule and 2BP policy by simulated step time.

Example::

    twobp plan --stages 4 --microbatches 8 --costs F=1,I=1,W=1 --memory-limit 6
    twobp plan --memory-limit 6 --recompute off,derivatives,all --weight-group-sizes 1,2

lists the candidates of :func:`twobp.sim.planner.evaluate` from the shortest
step to the longest with their bubble ratio and peak memory, marks those over
the per-rank memory limit, and prints the sentence of
:func:`twobp.sim.planner.recommend`, then what ``schedule="auto"`` would run on
the same cost model (:func:`auto_choice`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from twobp.cli.errors import UsageError, check_at_least
from twobp.cli.simulate import COSTS_HELP, cost_model
from twobp.config import add_arguments, doc, from_namespace
from twobp.schedule import SCHEDULES
from twobp.sim.analytic.shapes import SHAPE_FIELDS, DecoderShape
from twobp.sim.cost_io import format_amount, parse_amount
from twobp.sim.costs import CostModel
from twobp.sim.planner import ALL_POLICIES, SEARCHED_POLICIES, Candidate, evaluate, recommend
from twobp.sim.recompute import NO_RECOMPUTE, RECOMPUTE_AUTO, RECOMPUTE_MODES
from twobp.sim.search import NothingFitsError, auto_options, choose, describe, search

RECOMPUTE_CHOICES = (NO_RECOMPUTE, *RECOMPUTE_MODES, RECOMPUTE_AUTO)


@dataclass
class PlanConfig:
    """Options of ``twobp plan``."""

    stages: int = doc("number of pipeline ranks p (one process each)", 4)
    microbatches: int = doc("micro-batches per training step m", 8)
    stages_per_rank: int | None = doc(
        "stages per rank V for the schedules that hold several (interleaved-1f1b); "
        "others keep their own",
        None,
    )
    costs: str = doc(COSTS_HELP, "F=1,I=1,W=1")
    costs_file: str | None = doc(
        "a cost profile JSON (format: twobp.sim.costs); replaces --costs", None
    )
    memory_limit: str | None = doc(
        "memory limit per rank, in the cost model's unit (bytes for a profile; 16GiB, 80GB "
        "accepted; micro-batch activations for the default --costs); default: none",
        None,
    )
    # doc() gives list defaults a default_factory, so no list is shared.
    schedules: list[str] = doc("schedules to compare", [*SCHEDULES], choices=tuple(SCHEDULES))  # noqa: RUF009
    policies: list[str] = doc(  # noqa: RUF009
        "2BP policies to compare (off: as generated; dynamic only when named)",
        [*SEARCHED_POLICIES],
        choices=ALL_POLICIES,
    )
    data_parallel: int = doc(
        "copies of the pipeline D (D x stages ranks); each stage's gradients are all-reduced "
        "over its copies in the background after its last W, at the cost model's "
        "reduce_bandwidth (else bandwidth), "
        "taking its parameter bytes as the gradient size",
        1,
    )
    shard_optimizer: bool = doc(
        "the optimizer state sharded over each stage's copies (Pipeline.shard_optimizer, "
        "ZeRO-1): R reduce-scatters the gradients, the updated parameters are all-gathered "
        "before each stage's first F, and each rank holds 1/D of the cost model's "
        "optimizer_bytes",
        False,
    )
    shard_parameters: bool = doc(
        "with --model: search every layout with D > 1 also with each stage's parameters, "
        "gradients and optimizer state sharded over its copies (Pipeline(shard_parameters="
        "True), ZeRO-3: 1/D of them a rank, a stage's whole weights gathered from its first F "
        "to its last I, its weights all-gathered and gradients reduce-scattered each step), "
        "and say which layouts shard",
        False,
    )
    recompute: list[str] = doc(  # noqa: RUF009
        "recompute modes to compare, on every stage (off: none; activations: F again in I; "
        "derivatives: F and I again in W; all: both; auto: only the stashes over "
        "--memory-limit rebuilt, chosen per stage and micro-batch)",
        [NO_RECOMPUTE],
        choices=RECOMPUTE_CHOICES,
    )
    weight_group_sizes: list[int] = doc(  # noqa: RUF009
        "caps on the micro-batches one W concatenates (and rebuilds) at once to compare, "
        "besides no cap",
        [],
    )
    markdown: bool = doc("print the table as markdown", False)
    model: str | None = doc(
        "plan a named model on --gpus devices of kind --gpu from analytic costs "
        "(twobp.sim.analytic; llama)",
        None,
    )
    size: str = doc("size of --model (llama: 7b, 13b, 70b)", "7b")
    hf_config: str | None = doc(
        "plan the decoder of this Hugging Face config.json (LLaMA, Mistral, Qwen2, Mixtral "
        "keys) instead of --model; --layers ... override its sizes",
        None,
    )
    layers: int | None = doc("decoder layers (a custom decoder, or an override)", None)
    hidden: int | None = doc("decoder width", None)
    heads: int | None = doc("attention heads", None)
    ffn: int | None = doc("width of the MLP (of each expert)", None)
    vocab: int | None = doc("vocabulary size", None)
    kv_heads: int | None = doc("key-value heads (grouped-query attention); default: --heads", None)
    experts: int | None = doc("routed experts per layer (0: dense)", None)
    top_k: int | None = doc("experts per token (with --experts)", None)
    gpus: int = doc("devices to plan --model on", 8)
    gpu: str = doc(
        "device kind (h100, h200, a100-80g, mi300x, cpu) or a JSON of its figures", "h100"
    )
    seq_len: int = doc("tokens per sequence for --model", 4096)
    global_batch: int = doc("sequences per step, all copies together, for --model", 512)
    dtype: str = doc(
        "dtype of --model's weights and compute", "bfloat16", choices=("bfloat16", "float32")
    )
    tensor_parallel: list[int] = doc(  # noqa: RUF009
        "tensor-parallel sizes T a plan of --model searches (each within a node, dividing the "
        "heads)",
        [1, 2, 4, 8],
    )


MEMORY_KEYS = ("act", "grad", "param", "opt")
"""The keys of ``--costs`` that give memory sizes; without any, memory is counted in
micro-batch activations."""


@dataclass(frozen=True)
class Units:
    """What the figures of a plan are counted in.

    Args:
        sized: memory in bytes: ``--costs`` gives sizes (``act=``, ``grad=``,
            ``param=``, ``opt=``) or a profile does; else memory is counted in
            micro-batch activations (one per micro-batch held).
        seconds: times in seconds (a profile); else in the unit of ``--costs``' ``F``.
    """

    sized: bool
    seconds: bool

    @staticmethod
    def of(config: PlanConfig) -> Units:
        keys = {part.split("=", 1)[0].strip().lower() for part in config.costs.split(",")}
        profiled = bool(config.costs_file)
        return Units(profiled or bool(keys & set(MEMORY_KEYS)), profiled)

    def amount(self, value: float) -> str:
        """A memory figure with its unit."""
        if self.sized:
            return format_amount(value)
        return f"{value:.4g} micro-batch activation{'' if value == 1 else 's'}"

    def legend(self) -> str:
        """One line: the unit of every figure."""
        time = "seconds" if self.seconds else "the unit of --costs' F"
        memory = (
            "bytes"
            if self.sized
            else "micro-batch activations (give act=<bytes> in --costs to count bytes)"
        )
        return f"times in {time}, memory in {memory}"


def check_limit_unit(text: str | None, units: Units) -> None:
    """Refuse a memory limit in bytes for costs that count memory in micro-batches.

    Raises:
        UsageError: naming the limit and what costs to give.
    """
    if text is None or units.sized or not any(ch.isalpha() for ch in text):
        return
    raise UsageError(
        f"--memory-limit {text} is a size in bytes, but these costs count memory in "
        "micro-batch activations (no act=, grad= or param= in --costs): give the sizes, "
        "e.g. --costs F=1,I=1,W=1,act=1.1GiB,param=2GiB, or a profile with --costs-file "
        "(twobp profile), or a limit in micro-batches such as --memory-limit 6"
    )


def format_table(
    candidates: Sequence[Candidate],
    memory_limit: float | None,
    markdown: bool = False,
    units: Units | None = None,
) -> str:
    """The ranking as an aligned text table, or as markdown."""
    ran = [c for c in candidates if c.ok]
    best = min((c.makespan for c in ran), default=math.nan)
    # The recompute columns only where a candidate recomputes or caps its W groups.
    extra = any(c.recompute != NO_RECOMPUTE or c.weight_group_size for c in candidates)
    memory = "peak memory" if units is None or units.sized else "peak memory (activations)"
    header = ["#", "schedule", "2BP", "makespan", "throughput", "bubble", memory]
    header += ["recompute", "W group", ""] if extra else [""]
    rows = []
    for i, c in enumerate(candidates, 1):
        shown = f"auto ({c.rebuilds} rebuilt)" if c.recompute == RECOMPUTE_AUTO else c.recompute
        options = [shown, str(c.weight_group_size or "-")] if extra else []
        if not c.ok:
            rows.append(
                [str(i), c.schedule, c.policy, "-", "-", "-", "-", *options, f"n/a: {c.error}"]
            )
            continue
        over = memory_limit is not None and c.peak_memory > memory_limit
        rows.append(
            [
                str(i),
                c.schedule,
                c.policy,
                f"{c.makespan:.4g}",
                f"{best / c.makespan:.2f}x" if c.makespan > 0 else "-",
                f"{c.bubble_ratio:.1%}",
                format_amount(c.peak_memory),
                *options,
                "over memory limit" if over else "",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join([*header[:-1], "note"]) + " |"]
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {0, 3, 4, 5, 6}

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header)] + [line(r) for r in rows])


def run(config: PlanConfig) -> int:
    """Rank, print and recommend; returns the exit code.

    Raises:
        UsageError: on a count below 1 or a memory limit that is not a positive amount.
        ValueError: on options that do not fit together.
    """
    check_at_least(
        stages=(config.stages, 1),
        microbatches=(config.microbatches, 1),
        stages_per_rank=(config.stages_per_rank, 1),
        data_parallel=(config.data_parallel, 1),
    )
    for size in config.weight_group_sizes:
        check_at_least(weight_group_sizes=(size, 1))
    try:
        limit = parse_amount(config.memory_limit) if config.memory_limit else None
    except ValueError as exc:
        raise UsageError(f"--memory-limit {config.memory_limit}: {exc}") from exc
    if limit is not None and not limit > 0:
        raise UsageError(f"--memory-limit must be > 0, got {config.memory_limit}")
    if is_analytic(config):
        return run_analytic(config)
    if config.shard_parameters:
        raise UsageError(
            "--shard-parameters plans a model's shapes (--model, --hf-config or --layers ...): "
            "a cost model's parameter bytes do not say which part are the weights it gathers"
        )
    units = Units.of(config)
    check_limit_unit(config.memory_limit, units)
    costs = cost_model(config.costs, config.costs_file, config.stages)
    if config.shard_optimizer:
        costs = replace(costs, shard_optimizer=True)
    candidates = evaluate(
        costs,
        config.stages,
        config.microbatches,
        config.schedules,
        config.policies,
        config.stages_per_rank,
        limit,
        config.data_parallel,
        recomputes=config.recompute,
        weight_group_sizes=[None, *config.weight_group_sizes],
    )
    limit_text = (
        "no memory limit" if limit is None else f"memory limit {units.amount(limit)} per rank"
    )
    copies = f" x {config.data_parallel} copies" if config.data_parallel > 1 else ""
    if config.shard_optimizer:
        copies += ", optimizer sharded over them"
    print(
        f"{config.stages} ranks{copies}, {config.microbatches} micro-batches, {limit_text}; "
        f"{units.legend()}; throughput relative to the fastest"
    )
    print(format_table(candidates, limit, markdown=config.markdown, units=units))
    print()
    print(recommend(candidates, limit, units.amount))
    print(auto_choice(config, costs, limit, units, candidates))
    return 0


def is_analytic(config: PlanConfig) -> bool:
    """Whether the plan is of a model's shapes (``--model``, ``--hf-config``, ``--layers`` ...)."""
    given = any(getattr(config, k) is not None for k in SHAPE_FIELDS)
    return config.model is not None or config.hf_config is not None or given


def analytic_shape(config: PlanConfig) -> DecoderShape:
    """The decoder ``config`` names: a preset, a ``config.json`` or its sizes, with the
    sizes given on the command line taking the place of its own.

    Raises:
        ValueError: naming what is missing or wrong.
    """
    from twobp.sim.analytic.shapes import custom_shape, decoder_shape, hf_shape

    sizes = {k: getattr(config, k) for k in SHAPE_FIELDS if getattr(config, k) is not None}
    if config.model is not None and config.hf_config is not None:
        raise ValueError("--model and --hf-config both name a model: give one")
    if config.hf_config is not None:
        path = Path(config.hf_config)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--hf-config {path}: not a readable JSON file ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"--hf-config {path}: a config.json is an object, not {data!r:.40}")
        shape = hf_shape(data, str(data.get("_name_or_path") or path.parent.name or path.stem))
    elif config.model is not None:
        shape = decoder_shape(config.model, config.size)
    else:
        return custom_shape("custom decoder", **sizes)
    if not sizes:
        return shape
    own = {k: getattr(shape, k) for k in SHAPE_FIELDS}
    return custom_shape(f"{shape.name} (changed)", **{**own, **sizes})


def run_analytic(config: PlanConfig, shown: int = 3) -> int:
    """Plan a model's shapes on ``--gpus`` devices from analytic costs; returns the exit code.

    Raises:
        UsageError: an unknown model, size or device, or no layout that fits.
    """
    from twobp.sim.analytic import load_hardware, plan_layouts

    check_at_least(gpus=(config.gpus, 1), seq_len=(config.seq_len, 1))
    check_at_least(global_batch=(config.global_batch, 1))
    # `twobp train` builds a preset as it is (not a config.json, not changed sizes).
    preset = config.model is not None and all(getattr(config, k) is None for k in SHAPE_FIELDS)
    try:
        shape = analytic_shape(config)
        device = load_hardware(config.gpu)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for size in config.tensor_parallel:
        check_at_least(tensor_parallel=(size, 1))
    layouts = plan_layouts(
        shape,
        device,
        config.gpus,
        config.global_batch,
        config.seq_len,
        config.dtype,
        tensor_sizes=config.tensor_parallel,
        shard_parameters=(False, True) if config.shard_parameters else (False,),
    )
    print(
        f"{shape.name} ({shape.params / 1e9:.2f}B parameters) on {config.gpus} x {device.name} "
        f"({format_amount(device.memory)} each), {config.global_batch} sequences of "
        f"{config.seq_len} tokens per step, {config.dtype}; analytic costs (efficiency "
        f"{device.efficiency}), not measured"
    )
    if not layouts:
        raise UsageError(
            f"no layout of {shape.name} fits {config.gpus} x {device.name}: use more devices, "
            "a smaller --global-batch or --seq-len"
        )
    for i, layout in enumerate(layouts[:shown], 1):
        c = layout.candidate
        two_bp = {"off": "no 2BP", "own": "2BP (its own W placement)"}.get(
            layout.two_bp(), f"2BP {c.policy}"
        )
        if c.recompute != "off":
            two_bp += f", recompute {c.recompute!r}"
        if layout.shard_parameters:
            two_bp += ", parameters sharded"
        elif config.shard_parameters and layout.data > 1:
            two_bp += ", parameters whole (optimizer state sharded)"
        breakdown = ", ".join(f"{k} {format_amount(v)}" for k, v in layout.memory.items())
        print(
            f"{i}. P={layout.pipeline} D={layout.data} T={layout.tensor}, {c.schedule}, {two_bp}, "
            f"{layout.microbatches} micro-batches of {layout.microbatch}: "
            f"step {layout.step:.3g} s, "
            f"{layout.tokens_per_second:,.0f} tokens/s, MFU {layout.mfu:.1%}, "
            f"bubble {c.bubble_ratio:.1%}"
        )
        print(f"   memory per rank: {breakdown} (of {format_amount(device.memory)})")
        if preset:
            print(f"   twobp train --model {config.model} --size {config.size} {layout.options()}")
        print(f"   {layout.pipeline_options()}")
    return 0


def auto_choice(
    config: PlanConfig,
    costs: CostModel,
    limit: float | None,
    units: Units | None = None,
    table: Sequence[Candidate] = (),
) -> str:
    """What ``Pipeline(schedule="auto", costs=<these costs>)`` would run, in one sentence.

    The same options (:func:`twobp.sim.search.auto_options`: one pipeline per
    schedule, every stage count, 2BP policy and W cap; no recompute, or with
    ``--recompute auto`` among the modes compared and a limit, what
    ``recompute="auto"`` rebuilds), the same ranking and the same chooser as
    the pipeline's, on this cost model. Where it differs from the table's
    recommendation (``table``), the sentence says why.
    """
    amount = format_amount if units is None else units.amount
    rebuilding = RECOMPUTE_AUTO in config.recompute and limit is not None
    name = "schedule='auto'" + (", recompute='auto'," if rebuilding else "")
    choices = auto_options(
        config.microbatches,
        schedules=config.schedules,
        policies=config.policies,
        stages_per_rank=config.stages_per_rank,
        recompute=RECOMPUTE_AUTO if rebuilding else NO_RECOMPUTE,
    )
    ranking = search(
        choices, config.stages, config.microbatches, costs.for_stages, limit, config.data_parallel
    )
    try:
        best = choose(ranking, limit)
    except NothingFitsError as exc:
        return f"{name} on these costs: {exc}"
    said = (
        f"{name} on these costs would run {describe(best)} "
        f"(simulated step {best.makespan:.4g}, peak memory {amount(best.peak_memory)})"
    )
    return said + _why_auto_differs(best, ranking, table, limit)


def _why_auto_differs(
    best: Candidate, tried: Sequence[Candidate], table: Sequence[Candidate], limit: float | None
) -> str:
    """Why ``schedule="auto"``'s choice (``best``, of the options it ``tried``) is not the
    table's recommendation ("" where it is)."""
    try:
        recommended = choose(table, limit)
    except NothingFitsError:
        return ""
    if describe(recommended) == describe(best):
        return ""
    if SCHEDULES[recommended.schedule].pipelines > 1:
        return (
            f"; not {recommended.schedule}, which runs two pipelines over the same ranks: "
            "schedule='auto' tries one pipeline per schedule (pass the name to run it)"
        )
    if describe(recommended) not in {describe(c) for c in tried}:
        return (
            f"; the table's pick, {describe(recommended)}, is not among the options "
            "schedule='auto' tries (no recompute mode but 'auto', no weight_group_size)"
        )
    if best.makespan < recommended.makespan:
        return (
            "; faster than the table's pick: it also tries every stage count and cap on "
            "the micro-batches of a W, which the table keeps at one"
        )
    return (
        f"; the table's pick, {describe(recommended)}, is among its options but ties with "
        "it within 2%, broken by the step without contention"
    )


def _main(args: argparse.Namespace) -> int:
    try:
        return run(from_namespace(PlanConfig, args))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def register(subparsers: Any) -> None:
    """Add ``plan`` to the ``twobp`` command."""
    parser = subparsers.add_parser(
        "plan",
        help="rank schedules and 2BP policies by simulated throughput and memory",
        description=(
            "Rank every schedule and 2BP policy (and recompute mode and W group cap) by "
            "simulated step time, mark those over the memory limit and recommend one."
        ),
    )
    add_arguments(parser, PlanConfig)
    parser.set_defaults(func=_main)
