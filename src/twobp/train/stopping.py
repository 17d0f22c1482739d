"""Ending a run early on Ctrl-C, SIGTERM or SIGHUP: the step in flight finishes, then a
checkpoint.

The first stop signal only sets a flag (:class:`StopSignals`). At the end of
every step the ranks reduce their flags (:func:`agree_to_stop`, one scalar
all-reduce), so they all stop after the same step, however the signal reached
them: Ctrl-C sends SIGINT to every process of the terminal's group, ``kill``
reaches one process, and torchrun forwards the signal it gets to every rank.
The run then saves a checkpoint, writes its report and raises
:class:`TrainingInterrupted`. A second signal stops at once
(``KeyboardInterrupt``).

One signal often arrives twice, from the terminal and from a launcher that
forwards it (``twobp train``'s own, or torchrun): signals within
:data:`SAME_REQUEST_SECONDS` of the first count as one.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from twobp.runtime.base.group import Membership
from twobp.runtime.communication.collective import all_reduce, scalar

SAME_REQUEST_SECONDS = 0.5
"""Signals this soon after the first one are the same request (delivered twice)."""


class TrainingInterrupted(KeyboardInterrupt):
    """A run that stopped early on a signal, after saving (unless ``--no-save``).

    A ``KeyboardInterrupt``, so that a script that does not catch it ends as
    on Ctrl-C.

    Args:
        step: the steps done, the same on every rank.
        checkpoint: the checkpoint written at that step ("" if none).
        summary: the run's summary (see :func:`twobp.train.report.summarize`),
            None on the ranks other than 0 under torchrun.
    """

    def __init__(self, step: int, checkpoint: str, summary: dict[str, Any] | None) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step = step
        self.checkpoint = checkpoint
        self.summary = summary


class StopSignals:
    """Catch the first of ``signals`` as a request to stop; a later one stops at once.

    Used as a context manager, which installs the handler and puts the former
    ones back. Outside the main thread (where Python cannot handle signals)
    it installs nothing and ``requested`` stays False.

    Args:
        signals: the signals to catch (``signal.SIGINT``, ``signal.SIGTERM``, ``signal.SIGHUP``).
        on_first: called in the handler when the first signal arrives.
    """

    def __init__(
        self, signals: Sequence[int], on_first: Callable[[int], None] | None = None
    ) -> None:
        self.signals = tuple(signals)
        self.on_first = on_first
        self.requested = False
        self._first: float | None = None
        self._former: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._former[number] = signal.signal(number, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for number, former in self._former.items():
            signal.signal(number, former)
        self._former.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first, self.requested = now, True
            if self.on_first is not None:
                self.on_first(number)
            return
        if now - self._first < SAME_REQUEST_SECONDS:
            return
        raise KeyboardInterrupt


def agree_to_stop(world: Membership, device: torch.device, timeout: float, mine: bool) -> bool:
    """True on every rank if any rank asked to stop. Collective: one scalar all-reduce."""
    flag = all_reduce(
        world, scalar(float(mine), device), dist.ReduceOp.MAX, timeout, "the stop flag"
    )
    return bool(flag.item())
