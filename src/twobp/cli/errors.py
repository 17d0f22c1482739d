"""How ``twobp`` answers a mistake in its options: one line on stderr, exit code 2.

A mistake is anything the command can see before it starts work: an unknown
name, a number out of range, options that do not fit together, a file that
is missing or a folder it cannot write. The answer has the form argparse
gives its own errors, ``twobp <command>: error: <what and what to do>``,
without a usage block or a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

USAGE_EXIT_CODE = 2
"""Exit code of a mistake in the options (argparse's own)."""


class UsageError(Exception):
    """A mistake in the options of a sub-command; the message names the option."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser that reports a mistake in one line, without the usage block.

    Sub-command parsers made by ``add_subparsers`` take the class of their
    parent, so the whole command answers alike.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` and exit with code 2."""
        self.exit(USAGE_EXIT_CODE, f"{self.prog}: error: {one_line(message)}\n")


def one_line(message: str) -> str:
    """The first non-empty line of ``message`` (the rest is detail for a log)."""
    for line in message.splitlines():
        if line.strip():
            return line.strip()
    return message.strip()


def report_usage_error(prog: str, error: BaseException) -> int:
    """Print ``<prog>: error: <message>`` on stderr as one line.

    Returns:
        The exit code, 2.
    """
    print(f"{prog}: error: {one_line(str(error))}", file=sys.stderr)
    return USAGE_EXIT_CODE


def check_at_least(**options: tuple[float | None, float]) -> None:
    """Check numeric options against their least value; None means not given.

    Args:
        **options: ``name=(value, least)``; ``name`` is the field name
            (``microbatch_size`` for ``--microbatch-size``).

    Raises:
        UsageError: naming the first option below its least value.
    """
    for name, (value, least) in options.items():
        # Written so that NaN fails too.
        if value is not None and not value >= least:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
