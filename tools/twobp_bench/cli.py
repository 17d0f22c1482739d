"""The ``bench`` sub-command of ``twobp``: its options and what it prints.

:mod:`twobp.cli.bench` calls :func:`register` when this package is installed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from twobp.cli.errors import UsageError
from twobp.config import add_arguments, check_writable, from_namespace
from twobp_bench.config import BenchConfig


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark twobp schedules with and without 2BP against torch.distributed.pipelining",
        description=(
            "Run a matrix of variants on local ranks: twobp schedules without and with 2BP, "
            "torch.distributed.pipelining schedules on the same model, partition, batch and "
            "threads, and single-process references. Variants alternate round by round. "
            "Writes report.md, results.json and throughput.png into --out. The default (two "
            "LLaMA regimes, m = p, 2p, 8) takes about 10 minutes on 2 CPU cores; --quick and "
            "--overhead measure smaller matrices, --baseline adds another revision's twobp."
        ),
    )
    add_arguments(parser, BenchConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from twobp.runtime import LaunchError
    from twobp_bench.run import run_bench
    from twobp_bench.targets import shown_value

    cfg = from_namespace(BenchConfig, args)
    _check(cfg)
    try:
        results = run_bench(cfg, progress=lambda line: print(line, flush=True))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    except LaunchError as exc:
        print(f"twobp bench: {exc}", file=sys.stderr)
        return 1
    for target in results["targets"]:
        if target["value"] is None:
            continue
        status = {True: "met", False: "MISSED", None: ""}[target["met"]]
        print(
            f"{target['regime']}: {target['target']} = {shown_value(target)} {status} "
            f"({target['detail']})"
        )
    for regime in results["regimes"]:
        for group in regime["groups"]:
            for pair in group["against_baseline"]:
                print(
                    f"{regime['name']}, m={group['n_microbatches']}: speedup of {pair['twobp']} "
                    f"over {pair['baseline']} {pair['speedup']['median']:.3f}x"
                )
    print(f"report in {cfg.out}/report.md, chart in {cfg.out}/throughput.png")
    return 0


def _check(cfg: BenchConfig) -> None:
    """Check the options that the bench's own resolution leaves to its ranks.

    Raises:
        UsageError: naming the option.
    """
    from twobp.models import PRESETS, build_model

    try:
        check_writable("--out", cfg.out, folder=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for family in dict.fromkeys(m for m in cfg.model if m in PRESETS):
        try:
            build_model(family, cfg.size, device="meta", seed=None)
        except ValueError as exc:
            raise UsageError(f"--size {cfg.size}: {exc}") from exc
