"""``twobp simulate``: time a schedule on a cost model and draw it.

Example::

    twobp simulate --schedule 1f1b --stages 4 --microbatches 8 --policy paper \\
        --costs F=1,I=1,W=1 --png 1f1b.png --trace 1f1b.json

prints the rank-by-time grid, the makespan, the bubble ratio of every rank
and its peak memory; ``--png`` and ``--trace`` also write a picture and a
Chrome/Perfetto trace.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from twobp.cli.errors import UsageError, check_at_least
from twobp.config import add_arguments, check_writable, doc, from_namespace
from twobp.schedule import SCHEDULES, TWO_BP_POLICIES, Schedule
from twobp.schedule.action import Kind
from twobp.sim.cost_io import format_amount, load_costs, parse_costs
from twobp.sim.costs import CostModel
from twobp.sim.planner import NO_TWO_BP, build_schedule
from twobp.sim.simulate import DeadlockError, SimResult, simulate
from twobp.sim.steady import steady_state
from twobp.viz.ascii import render_ascii

COSTS_HELP = (
    "times and sizes of one rank's share of the model, as key=value pairs: F, I, W (times of "
    "one micro-batch), B (fused backward, default I+W), W<n> (W over n concatenated "
    "micro-batches, e.g. W4=3), latency, bandwidth, send_overhead (seconds a send holds its "
    "sender), reduce_bandwidth (bytes/s per rank of a gradient all-reduce, default bandwidth), "
    "send (bytes per micro-batch), act, grad, "
    "param (memory per micro-batch / per stage), contention (how many times slower every rank "
    "computes while all compute at once, default 1), jitter (each action's time drawn around "
    "its cost with this relative spread, e.g. 0.1; one draw per stage, kind and micro-batch) "
    "and seed (which draw); with V stages per rank each stage takes 1/V"
)


@dataclass
class SimulateConfig:
    """Options of ``twobp simulate``."""

    schedule: str = doc("the schedule to simulate", "1f1b", choices=tuple(SCHEDULES))
    stages: int = doc("number of pipeline ranks p (one process each)", 4)
    microbatches: int = doc("micro-batches per training step m", 8)
    stages_per_rank: int | None = doc(
        "stages per rank V (default: the schedule's own, 2 for interleaved-1f1b and V shapes)", None
    )
    policy: str = doc(
        "2BP policy placing the weight passes: off (as generated), " + ", ".join(TWO_BP_POLICIES),
        NO_TWO_BP,
        choices=(NO_TWO_BP, *TWO_BP_POLICIES),
    )
    costs: str = doc(COSTS_HELP, "F=1,I=1,W=1")
    costs_file: str | None = doc(
        "a cost profile JSON (format: twobp.sim.costs); replaces --costs", None
    )
    data_parallel: int = doc(
        "copies of the pipeline D (D x stages ranks); each replicated stage (every stage "
        "with D > 1, and Chimera's, held by both pipelines) all-reduces its gradients in the "
        "background after its last W (the R action), at the cost model's reduce_bandwidth "
        "(else bandwidth), taking its parameter bytes as the gradient size",
        1,
    )
    png: str | None = doc("also draw the timeline to this PNG file", None)
    trace: str | None = doc("also write a Chrome/Perfetto trace JSON to this file", None)
    width: int = doc("most characters per line of the grid", 120)


def cost_model(costs: str, costs_file: str | None, n_ranks: int) -> CostModel:
    """The cost model of the options: a profile file if given, else the text form.

    Args:
        costs: the ``--costs`` text (one rank's share of the model per stage).
        costs_file: a profile JSON, or ``None``.
        n_ranks: number of ranks ``p``; the text form makes ``p`` stages.

    Returns:
        The cost model, to be fitted to a schedule with
        :meth:`CostModel.for_stages`.

    Raises:
        ValueError: if the text or the file is malformed or the file cannot
            be read, naming the option.
    """
    if not costs_file:
        try:
            return parse_costs(costs, n_ranks)
        except ValueError as exc:
            raise ValueError(f"--costs {costs}: {exc}") from exc
    try:
        return load_costs(costs_file)
    except OSError as exc:
        raise ValueError(
            f"--costs-file {costs_file}: {exc.strerror or exc}; write one with `twobp profile`"
        ) from exc
    except ValueError as exc:
        message = str(exc).removeprefix(f"{costs_file}: ")
        raise ValueError(f"--costs-file {costs_file}: {message}") from exc


def time_unit(costs_file: str | None) -> str:
    """The unit of the simulated times: seconds for a profile, else the costs' own unit."""
    return "s" if costs_file else "time units"


def report(
    result: SimResult, schedule: Schedule, costs: CostModel, unit: str = "time units"
) -> str:
    """The figures printed under the grid; times in ``unit``."""
    steady = steady_state(schedule, costs)
    m = schedule.n_microbatches
    per = "s" if unit == "s" else "time unit"
    lines = [
        f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_stages} stages, {m} micro-batches",
        f"makespan {result.makespan:.4g} {unit} ({m / result.makespan:.4g} micro-batches per {per})"
        if result.makespan > 0
        else "makespan 0",
        f"bubble ratio {result.bubble_ratio:.1%}; with steps back to back (no barrier between "
        f"them): {steady.period:.4g} per step, bubble ratio {steady.bubble_ratio:.1%}",
        "",
        f"{'rank':>4}  {'busy':>8}  {'idle':>8}  {'bubble':>7}  {'peak memory':>11}",
    ]
    for r in range(result.n_ranks):
        lines.append(
            f"{r:>4}  {result.busy[r]:>8.4g}  {result.idle[r]:>8.4g}  "
            f"{result.bubble_ratios[r]:>7.1%}  {format_amount(result.peak_memory[r]):>11}"
        )
    reductions = [s for s in result.spans if s.action.kind is Kind.REDUCE]
    if reductions:
        ends = ", ".join(
            f"rank {r} {max(s.end for s in reductions if s.rank == r):.4g}"
            for r in sorted({s.rank for s in reductions})
        )
        lines += ["", f"gradient all-reduces (R, in the background, not drawn) end at: {ends}"]
    return "\n".join(lines)


def check_options(config: SimulateConfig) -> None:
    """Check what can be checked of the options before simulating.

    Raises:
        UsageError: naming the option.
    """
    check_at_least(
        stages=(config.stages, 1),
        microbatches=(config.microbatches, 1),
        stages_per_rank=(config.stages_per_rank, 1),
        data_parallel=(config.data_parallel, 1),
    )
    for option, path in (("--png", config.png), ("--trace", config.trace)):
        if path:
            try:
                check_writable(option, path, folder=False)
            except ValueError as exc:
                raise UsageError(str(exc)) from exc


def run(config: SimulateConfig) -> int:
    """Simulate, print and optionally draw; returns the exit code.

    Raises:
        ValueError: on options that do not fit together.
        DeadlockError: if the schedule cannot finish.
    """
    costs = cost_model(config.costs, config.costs_file, config.stages)
    try:
        schedule, fitted = build_schedule(
            config.schedule,
            config.stages,
            config.microbatches,
            config.stages_per_rank,
            config.policy,
            costs,
            data_parallel=config.data_parallel,
        )
    except ValueError as exc:
        raise ValueError(f"--schedule {config.schedule}: {exc}") from exc
    result = simulate(schedule, fitted)
    try:
        grid = render_ascii(
            result.spans, title=schedule.name, width=config.width, n_ranks=schedule.n_ranks
        )
    except ValueError as exc:
        raise ValueError(f"--width {config.width}: {exc}") from exc
    print(grid)
    print()
    unit = time_unit(config.costs_file)
    print(report(result, schedule, fitted, unit))
    if config.png:
        from twobp.viz.png import render_png

        png = render_png(
            result.spans,
            config.png,
            title=schedule.name,
            n_ranks=schedule.n_ranks,
            time_unit=unit,
        )
        print(f"wrote {png}")
    if config.trace:
        from twobp.viz.trace import write_trace

        print(f"wrote {write_trace(result.spans, config.trace, title=schedule.name)}")
    return 0


def _main(args: argparse.Namespace) -> int:
    config = from_namespace(SimulateConfig, args)
    check_options(config)
    try:
        return run(config)
    except (ValueError, DeadlockError) as exc:
        raise UsageError(str(exc)) from exc


def register(subparsers: Any) -> None:
    """Add ``simulate`` to the ``twobp`` command."""
    parser = subparsers.add_parser(
        "simulate",
        help="time a schedule on a cost model and draw it",
        description=(
            "Time a schedule on a cost model, print the rank-by-time grid, makespan, "
            "bubble ratios and peak memory, and optionally draw it."
        ),
    )
    add_arguments(parser, SimulateConfig)
    parser.set_defaults(func=_main)
