"""What a ``twobp train`` run keeps of a failure: each rank's output and every traceback.

Unless ``--verbose``, every local rank writes its stderr (warnings, messages
of the communication backend, the traceback the launcher prints when the
rank fails) into ``OUT/logs/rank<N>.log`` instead of the terminal; rank 0's
progress line stays on the terminal. When a rank fails, ``OUT/errors.log``
gets every failed rank's error and traceback, the cause first, and
:func:`failure_summary` is the short account the command prints.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from twobp.runtime.errors import LaunchError, RankFailure

ERROR_LOG = "errors.log"
"""The file in ``--out`` with the tracebacks of the last run that failed."""

RANK_LOGS = "logs"
"""The folder in ``--out`` with each rank's stderr (``rank<N>.log``)."""

SHORT_LENGTH = 150
"""Characters of a failed rank's line in the summary (two lines of a terminal)."""


def send_stderr_to(path: Path) -> TextIO:
    """Send this process's stderr, Python's and the C++ libraries', to ``path``.

    The redirection lasts for the rest of the process, so that the traceback
    :func:`twobp.runtime.launch` prints when the rank fails goes there too.

    Returns:
        A stream on the former stderr (the terminal), for the progress line.
    """
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, sys.stderr.fileno())
    os.close(log)
    return terminal


def write_error_log(error: LaunchError, out: Path) -> Path:
    """Write every failed rank's error and traceback into ``out/errors.log``.

    Returns:
        The path of the log.
    """
    path = out / ERROR_LOG
    parts = [_first_line(str(error)), *("  " + _first_line(f.summary()) for f in error.failures)]
    for failure in error.failures:
        parts += ["", failure.summary(), _details(failure)]
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")
    return path


def failure_summary(error: LaunchError, out: Path, verbose: bool) -> str:
    """The short account of a failed run: which ranks, what error, where the rest is.

    One line per failed rank, the cause first: its error, cut to the first
    sentence if long (the whole is in ``errors.log``).

    Args:
        error: the launcher's error.
        out: the run's output folder (with ``errors.log``).
        verbose: whether the ranks printed their tracebacks on the terminal.
    """
    lines = [_first_line(str(error)), *("  " + _short(f) for f in error.failures)]
    where = f"tracebacks in {out / ERROR_LOG}"
    if not verbose:
        where += f", each rank's output in {out / RANK_LOGS}/ (--verbose prints them here)"
    return "\n".join([*lines, where])


def _short(failure: RankFailure) -> str:
    """``rank 1: ValueError: what`` in at most about two lines of a terminal."""
    text = _first_line(failure.summary())
    # Errors raised on every rank name the rank again at the start of their message.
    text = text.replace(f": rank {failure.rank}: ", ": ", 1)
    if len(text) <= SHORT_LENGTH:
        return text
    end = text.find(". ", len(f"rank {failure.rank}: {failure.error_type}: "))
    if 0 < end < SHORT_LENGTH:
        return text[: end + 1] + " (more in the log)"
    return text[:SHORT_LENGTH].rsplit(" ", 1)[0] + " ... (more in the log)"


def _details(failure: RankFailure) -> str:
    if failure.traceback:
        return failure.traceback.rstrip()
    if failure.stack:
        return "where it was when it was terminated:\n" + failure.stack.rstrip()
    return "(no traceback: the process ended without reporting an error)"


def _first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), text)
