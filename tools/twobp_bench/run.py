"""Run the whole bench: one launched group per regime, then the report files.

Writes into the output folder:

- ``report.md``: the tables (2BP against no 2BP, twobp against torch, targets, every variant);
- ``results.json``: every figure and every raw step time, for machines;
- ``throughput.png``: samples per second of every variant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from twobp.runtime import launch
from twobp_bench.analysis import analyse_regime
from twobp_bench.baseline import export_baseline
from twobp_bench.chart import render_chart
from twobp_bench.config import BenchConfig, resolve
from twobp_bench.job import run_regime
from twobp_bench.report import render_markdown
from twobp_bench.targets import evaluate


def run_bench(
    cfg: BenchConfig,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every regime of ``cfg`` and write the report files into ``cfg.out``.

    Args:
        cfg: the options.
        command: the command line to print in the report (default: this process's).
        progress: called with a line of text as each regime starts and ends.

    Returns:
        The results dictionary (what ``results.json`` holds).

    Raises:
        ValueError: on options that do not fit together, or a baseline git
            cannot export (before any process starts).
        twobp.runtime.LaunchError: if a rank failed.
    """
    plan = resolve(cfg)
    say = progress or (lambda _line: None)
    started = time.time()
    load_before = list(os.getloadavg())
    regimes = []
    folder = export_baseline(plan.baseline) if plan.baseline is not None else None
    if folder is not None:
        plan = dataclasses.replace(plan, baseline_path=str(folder))
    try:
        for regime in plan.regimes:
            say(f"regime {regime.name}: {regime.description}")
            t0 = time.perf_counter()
            reports = launch(
                run_regime,
                plan.n_ranks * plan.data_parallel,
                plan,
                regime,
                threads_per_rank=plan.threads,
                group_timeout=plan.timeout,
            )
            # Copy 0 (the first n_ranks processes) speaks for the copies.
            regimes.append(
                analyse_regime(reports[: plan.n_ranks], plan.n_ranks, plan.data_parallel)
            )
            say(f"regime {regime.name}: done in {time.perf_counter() - t0:.0f} s")
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    results = {
        "command": command or " ".join(["twobp", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started,
        "machine": _machine(load_before),
        "n_ranks": plan.n_ranks,
        "data_parallel": plan.data_parallel,
        "share_model": plan.share_model,
        "threads": plan.threads,
        "rounds": plan.rounds,
        "warmup": plan.warmup,
        "baseline": plan.baseline,
        "plan": _jsonable(dataclasses.asdict(plan)),
        "regimes": regimes,
        "targets": evaluate(regimes, plan.n_ranks),
    }
    write_outputs(results, Path(cfg.out))
    return results


def write_outputs(results: dict[str, Any], out: Path) -> None:
    """Write ``report.md``, ``results.json`` and ``throughput.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=1))
    (out / "report.md").write_text(render_markdown(results))
    render_chart(results, out / "throughput.png")


def _machine(load_before: Sequence[float]) -> dict[str, Any]:
    return {
        "cpu": _cpu_name(),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _jsonable(value: Any) -> Any:
    """Mappings, sequences and numbers as JSON takes them (inf and NaN become None)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "items"):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)
