"""What ``twobp train`` tells the person running it, on a console that may go away.

A run's output often goes through a pipe (``2>&1 | tee run.log``) or to a
terminal, and either may close while the run goes on: Ctrl-C stops the
``tee`` with the run, the terminal is closed, ``| head`` has read enough.
A write then raises (``BrokenPipeError``, or ``OSError`` EIO from a terminal
that hung up) wherever it happens, and would end the run on its way to its
stop checkpoint. A :class:`ConsoleStream` goes quiet instead. The command's
own lines (notices, the closing summary, the command that continues a
stopped run) also go to ``OUT/train.log`` (:data:`RUN_LOG`), which has them
when no console saw them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

RUN_LOG = "train.log"
"""The file in ``--out`` with the lines ``twobp train`` wrote for its user, apart from the
progress: notices (a stop, skipped steps), the closing lines, how to continue a stopped run."""


class ConsoleStream:
    """A text stream that drops what is written once its reader is gone, rather than raise.

    After the first write or flush that fails, the stream's file descriptor is
    pointed at ``/dev/null``, so that the other writers of this process (its
    warnings, Python's own flush at exit) go quietly as well.

    Args:
        stream: the stream to write to (a terminal, a pipe, a file).
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False
        """True once a write failed: the reader is gone and nothing more is written."""

    def write(self, text: str) -> int:
        """Write ``text`` and flush it (so that a closed reader shows at once)."""
        if not self.gone:
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # ValueError: the stream was closed here
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._silence()

    def isatty(self) -> bool:
        try:
            return not self.gone and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def _silence(self) -> None:
        self.gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)
            # What the failed write left in the stream's buffer now drains into /dev/null.
            self.stream.flush()
        except (OSError, ValueError):
            pass


def log_line(out: Path, text: str) -> None:
    """Append ``text`` as a line to ``out``'s :data:`RUN_LOG`.

    Opened for each line, as it is written from signal handlers and from
    several processes (the launcher and rank 0) at once.
    """
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RUN_LOG, "a") as log:
        log.write(text + "\n")


def start_log(out: Path) -> None:
    """Begin a run's :data:`RUN_LOG` afresh (the files in ``--out`` are those of the last run)."""
    (out / RUN_LOG).unlink(missing_ok=True)


class Console:
    """The command's own lines: on stdout (or stderr), and in ``out``'s :data:`RUN_LOG`.

    Args:
        out: the run's output folder.
        stdout: where :meth:`say` writes (default ``sys.stdout``).
        stderr: where :meth:`warn` writes, and :meth:`say` once stdout is gone
            (default ``sys.stderr``).
    """

    def __init__(
        self, out: Path, stdout: TextIO | None = None, stderr: TextIO | None = None
    ) -> None:
        self.out = out
        self.stdout = ConsoleStream(stdout or sys.stdout)
        self.stderr = ConsoleStream(stderr or sys.stderr)

    def say(self, text: str) -> None:
        """A line of the run's result: on stdout, or on stderr if stdout is gone; logged."""
        log_line(self.out, text)
        self.stdout.write(text + "\n")
        if self.stdout.gone:
            self.stderr.write(text + "\n")

    def warn(self, text: str) -> None:
        """A notice or an error: on stderr; logged."""
        log_line(self.out, text)
        self.stderr.write(text + "\n")
