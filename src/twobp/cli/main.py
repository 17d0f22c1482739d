"""Entry point of the ``twobp`` command.

Each sub-command lives in its own module of this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to the
function that runs it (taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

import twobp

# Sub-command modules, in the order `twobp --help` lists them.
SUBCOMMANDS = ("train", "simulate", "plan", "profile", "bench", "checkpoint")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every sub-command that is installed."""
    parser = argparse.ArgumentParser(
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
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
