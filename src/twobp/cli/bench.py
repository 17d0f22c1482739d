"""``twobp bench``: the benchmark application, which lives in its own package.

The library does not depend on the bench: the ``twobp_bench`` package (``tools/`` of the
repository, installed with it) registers the sub-command. Where it is missing,
``twobp bench`` says how to get it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

MISSING = (
    "twobp bench: the benchmark application (package twobp_bench) is not installed; "
    "install twobp from its repository (pip install -e . in a checkout) to get it"
)


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command: the bench's own, or one that says it is missing."""
    try:
        from twobp_bench.cli import register as register_bench
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "twobp_bench":
            raise
        # The bench's options are not known here: every word after "bench" (those that
        # start with "-" too) goes to one argument, and the command says what is missing.
        parser = subparsers.add_parser(
            "bench",
            help="benchmark schedules (needs the twobp_bench package)",
            add_help=False,
            prefix_chars="\0",
        )
        parser.add_argument("words", nargs=argparse.REMAINDER)
        parser.set_defaults(func=_missing)
        return
    register_bench(subparsers)


def _missing(args: argparse.Namespace) -> int:
    print(MISSING, file=sys.stderr)
    return 2
