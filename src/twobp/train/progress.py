"""A dependency-free progress line: a bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Prints ``step/total [####....] loss ... samples/s ...`` as training goes.

    Args:
        total: number of steps.
        every: steps between updates when the stream is not a terminal.
        stream: where to write (default stderr).
    """

    def __init__(self, total: int, every: int = 10, stream: TextIO | None = None) -> None:
        self.total = total
        self.every = max(1, every)
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_draw = 0.0

    def update(
        self, step: int, loss: float, samples_per_s: float, tokens_per_s: float | None
    ) -> None:
        """Show the state after ``step`` (1-based count of finished steps).

        ``tokens_per_s`` is None for data without tokens (images).
        """
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} "
            f"loss {loss:7.4f}  {samples_per_s:8.1f} samples/s"
        )
        if tokens_per_s is not None:
            text += f"  {tokens_per_s:9.0f} tokens/s"
        if self.is_tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and step != self.total:
                return
            self._last_draw = now
            width = 24
            filled = int(width * step / max(1, self.total))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            if step == self.total:
                self.stream.write("\n")
        elif step % self.every == 0 or step == self.total or step == 1:
            self.stream.write(text + "\n")
        self.stream.flush()
