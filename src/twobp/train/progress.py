"""The progress of a run: a tqdm bar on a terminal, plain log lines elsewhere.

On a terminal, tqdm draws the bar with the elapsed time, the ETA and the step
rate, and the latest loss and throughput after it. In a log file (stderr not
a terminal), a bar's carriage returns are noise: every ``every`` steps (and
at the first and the last) one plain line says the same.

The step rate and the ETA leave out the first ``warmup`` steps of a run: they
agree tensor shapes and, with ``--compile``, compile the stages (a minute, where
a step then takes a tenth of a second), and would make the ETA absurd for long
after. Until those steps are done, the rate and the ETA show ``?``.

What it writes goes quiet once the stream's reader is gone (a closed pipe, a
terminal that hung up; see :mod:`twobp.train.console`): the run goes on.
Its notes (:meth:`Progress.note`) also go to the run's log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from twobp.train.console import ConsoleStream, log_line


class _Bar(tqdm):  # type: ignore[misc]
    """A tqdm bar whose step rate (and so its ETA) is the one :class:`Progress` measures."""

    rate: float | None = None
    """Steps per second after the warm-up; None: not known yet (shown as ``?``)."""

    @property
    def format_dict(self) -> dict[str, Any]:
        figures = dict(super().format_dict)
        figures["rate"] = self.rate or 0.0  # 0: tqdm shows "?"
        return figures


class Progress:
    """Shows ``step/total``, the loss, samples/s (and tokens/s), the step rate and the ETA.

    Args:
        total: the step the run ends at.
        every: steps between plain lines when the stream is not a terminal.
        stream: where to write (default stderr).
        initial: steps done before this run started (a resumed run).
        out: the run's output folder, whose log (:data:`twobp.train.console.RUN_LOG`)
            gets the notes too; None: no log.
        warmup: this run's first steps, left out of the step rate and the ETA.
        clock: the time in seconds (tests pass their own).
    """

    def __init__(
        self,
        total: int,
        every: int = 10,
        stream: TextIO | ConsoleStream | None = None,
        initial: int = 0,
        out: Path | None = None,
        warmup: int = 0,
        clock: Callable[[], float] = time.monotonic,
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
            _Bar(
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
        self.clock = clock
        self._timed_from = initial + max(0, warmup)  # the rate counts the steps after it
        self._timed_start: float | None = clock() if warmup <= 0 else None

    def rate(self, step: int) -> float | None:
        """Steps per second after the warm-up, ``step`` just done; None before it ends."""
        now = self.clock()
        if self._timed_start is None or step <= self._timed_from:
            if step >= self._timed_from:  # the warm-up ends: time from here
                self._timed_from, self._timed_start = step, now
            return None
        elapsed = now - self._timed_start
        return (step - self._timed_from) / elapsed if elapsed > 0 else None

    def update(
        self, step: int, loss: float, samples_per_s: float, tokens_per_s: float | None
    ) -> None:
        """Show the state after ``step`` (1-based count of finished steps).

        ``tokens_per_s`` is None for data without tokens (images).
        """
        figures = f"loss {loss:7.4f}  {samples_per_s:8.1f} samples/s"
        if tokens_per_s is not None:
            figures += f"  {tokens_per_s:9.0f} tokens/s"
        rate = self.rate(step)
        if self._bar is not None:
            self._bar.rate = rate
            self._bar.set_postfix_str(figures, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.every and step not in (self.initial + 1, self.total):
            return
        speed, eta = "?", "?"
        if rate is not None:
            speed = f"{rate:.2f}"
            eta = tqdm.format_interval(round((self.total - step) / rate))
        self.stream.write(
            f"step {step:>{len(str(self.total))}}/{self.total} {figures}  "
            f"{speed} steps/s, eta {eta}\n"
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
