"""The progress of a run: a tqdm bar on a terminal, plain log lines elsewhere.

On a terminal, tqdm draws the bar with the elapsed time, the ETA and the step
rate, and the latest loss and throughput after it. In a log file (stderr not
a terminal), a bar's carriage returns are noise: every ``every`` steps (and
at the first and the last) one plain line says the same.

What it writes goes quiet once the stream's reader is gone (a closed pipe, a
terminal that hung up; see :mod:`twobp.train.console`): the run goes on.
Its notes (:meth:`Progress.note`) also go to the run's log.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from twobp.train.console import ConsoleStream, log_line


class Progress:
    """Shows ``step/total``, the loss, samples/s (and tokens/s), the step rate and the ETA.

    Args:
        total: the step the run ends at.
        every: steps between plain lines when the stream is not a terminal.
        stream: where to write (default stderr).
        initial: steps done before this run started (a resumed run).
        out: the run's output folder, whose log (:data:`twobp.train.console.RUN_LOG`)
            gets the notes too; None: no log.
    """

    def __init__(
        self,
        total: int,
        every: int = 10,
        stream: TextIO | ConsoleStream | None = None,
        initial: int = 0,
        out: Path | None = None,
    ) -> None:
        self.total = total
        self.every = max(1, every)
        self.initial = initial
        self.out = out
        if not isinstance(stream, ConsoleStream):
            stream = ConsoleStream(stream if stream is not None else sys.stderr)
        self.stream = stream
        is_tty = self.stream.isatty()
        self._bar = (
            tqdm(
                total=total,
                initial=initial,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                smoothing=0.1,
                leave=True,
            )
            if is_tty
            else None
        )
        self._start = time.monotonic()

    def update(
        self, step: int, loss: float, samples_per_s: float, tokens_per_s: float | None
    ) -> None:
        """Show the state after ``step`` (1-based count of finished steps).

        ``tokens_per_s`` is None for data without tokens (images).
        """
        figures = f"loss {loss:7.4f}  {samples_per_s:8.1f} samples/s"
        if tokens_per_s is not None:
            figures += f"  {tokens_per_s:9.0f} tokens/s"
        if self._bar is not None:
            self._bar.set_postfix_str(figures, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.every and step not in (self.initial + 1, self.total):
            return
        elapsed = time.monotonic() - self._start
        done = step - self.initial
        rate = done / elapsed if elapsed > 0 else float("inf")
        left = (self.total - step) / rate if rate > 0 else math.inf
        eta = tqdm.format_interval(left) if math.isfinite(left) else "?"
        self.stream.write(
            f"step {step:>{len(str(self.total))}}/{self.total} {figures}  "
            f"{rate:.2f} steps/s, eta {eta}\n"
        )
        self.stream.flush()

    def note(self, text: str) -> None:
        """Write one line of its own, below the bar on a terminal, and into the log."""
        if self.out is not None:
            log_line(self.out, text)
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
            return
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar (its last state stays on the terminal)."""
        if self._bar is not None:
            self._bar.close()
