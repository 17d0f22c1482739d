"""``twobp train``: the main job (see :mod:`twobp.train`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from twobp.cli.errors import UsageError
from twobp.config import add_arguments, from_namespace
from twobp.train.config import TrainConfig


def register(subparsers: Any) -> None:
    """Add the ``train`` sub-command."""
    parser = subparsers.add_parser(
        "train",
        help="train a reference model with a pipeline schedule (the main job)",
        description=(
            "Train a reference model over local ranks (or the ranks of torchrun) and write a "
            "report: throughput, bubble ratio, peak memory per rank, loss curve and the last "
            "step's timeline. Defaults: the tiny LLaMA-like model as a byte-level language "
            "model on Python's own sources, 2 ranks, 1f1b with 2BP. Checkpoints go to "
            "OUT/checkpoints; --resume OUT continues a run where it stopped (under torchrun "
            "--max-restarts, pass --resume auto). Options are checked before any rank starts; "
            "if a rank fails, the command prints one line per failed rank and writes the "
            "tracebacks to OUT/errors.log (exit code 1)."
        ),
    )
    add_arguments(parser, TrainConfig)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from twobp.runtime import LaunchError, PipelineError
    from twobp.train.failures import failure_summary
    from twobp.train.preflight import OptionError
    from twobp.train.report import throughput
    from twobp.train.run import run_training

    cfg = from_namespace(TrainConfig, args)
    try:
        summary = run_training(cfg)
    except OptionError as exc:
        raise UsageError(str(exc)) from exc
    except LaunchError as exc:
        print(f"twobp train: {failure_summary(exc, Path(cfg.out), cfg.verbose)}", file=sys.stderr)
        return 1
    except PipelineError as exc:
        # This rank's error under torchrun, which then ends or restarts the group.
        print(f"twobp train: {exc}", file=sys.stderr)
        return 1
    if summary is not None:
        print(
            f"done: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, "
            f"held-out {summary['eval_loss']:.3f}; {throughput(summary)}; "
            f"bubble {summary['bubble_ratio']:.3f}; report in {cfg.out}/report.md"
        )
        if summary["steps_run"] < cfg.steps:
            print(
                f"stopped after step {summary['steps_run']} of {cfg.steps}; continue with the "
                f"same options and --resume {cfg.out}"
            )
    return 0
