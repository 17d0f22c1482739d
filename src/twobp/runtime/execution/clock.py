"""Timestamps of the actions of one step, on the CPU or on the GPU's stream.

On the CPU an action's time is wall-clock time (``time.perf_counter``). On a
GPU the CPU only queues kernels, so CPU time would show launch times; there
the clock records CUDA events on the current stream and reads their times
once the step is over, so a span covers the action's kernels and a wait for a
transfer shows as idle time.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    """Marks taken during one step, read as seconds from the step start.

    Args:
        device: the device the step computes on.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._origin: Any = self.mark()

    def mark(self) -> Any:
        """A point in time: a float on the CPU, a recorded CUDA event on a GPU."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def reach(self, mark: Any) -> None:
        """Wait until the device has got to ``mark`` (at once on the CPU, where marks are
        taken as the work is done)."""
        if self._cuda:
            mark.synchronize()

    def seconds(self, mark: Any) -> float:
        """Seconds from the step start to ``mark`` (waits for the GPU to get there)."""
        if not self._cuda:
            return float(mark - self._origin)
        mark.synchronize()
        return float(self._origin.elapsed_time(mark)) / 1000.0
