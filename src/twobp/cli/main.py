"""Entry point of the ``twobp`` command.

Each sub-command lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to the
function that runs it (taking the parsed namespace, returning an exit code).
A mistake in the options, found by argparse or raised by ``func`` as
:class:`~twobp.cli.errors.UsageError`, is answered in one line with exit
code 2 (see :mod:`twobp.cli.errors`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

import twobp
from twobp.cli.errors import OneLineParser, UsageError, report_usage_error

# Sub-command modules, in the order `twobp --help` lists them.
SUBCOMMANDS = ("train", "simulate", "plan", "profile", "bench", "checkpoint")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every sub-command that is installed."""
    parser = OneLineParser(
        prog="twobp",
        description=(
            "Pipeline-parallel training with 2-stage backpropagation (2BP): "
            "train, simulate and plan pipeline schedules."
        ),
    )
    parser.add_argument("--version", action="version", version=f"twobp {twobp.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module_name = f"twobp.cli.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``twobp`` command; returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a mistake argparse found
        return exc.code if isinstance(exc.code, int) else 0
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        return report_usage_error(f"twobp {args.command}", exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout left (`twobp plan | head`): what it wanted, it has. Point
        # stdout at nothing so that the interpreter's own flush at exit does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
