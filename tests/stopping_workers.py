"""Step hooks of ``twobp train`` that send stop signals from inside a run (see test_train_stopping).

Each runs on every local rank before each step (``on_step``); it acts on rank
1 before step ``STOP_AT`` (an environment variable, which the ranks inherit).
The launcher is the process named by ``LAUNCHER_PID`` (the test's own): a rank
forked by launch's server is not the launcher's child. A hook that needs the launcher to
have acted waits for the SIGINT the launcher passes on (:class:`SignalsSeen`), not for a
while.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from types import TracebackType

LIMIT = 60.0
"""Seconds :meth:`SignalsSeen.wait_for` waits before it calls the signal lost (a test whose
order broke; it decides nothing when the run works)."""


class SignalsSeen:
    """The signals this process receives while the context is open, as they arrive.

    The signal module writes each signal's number to a wake-up pipe before the Python
    handler runs (:func:`signal.set_wakeup_fd`): waiting on the pipe waits for the signal
    itself. Only signals with a Python handler (the run's stop signals) are seen. In the
    main thread only.
    """

    def __enter__(self) -> SignalsSeen:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._former = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        signal.set_wakeup_fd(self._former)
        os.close(self._read)
        os.close(self._write)

    def wait_for(self, number: int) -> None:
        """Block until signal ``number`` arrives (its handler has run when this returns).

        Raises:
            AssertionError: if it did not arrive within :data:`LIMIT` seconds.
        """
        while True:
            ready, _, _ = select.select([self._read], [], [], LIMIT)
            if not ready:
                name = signal.Signals(number).name
                raise AssertionError(f"no {name} reached this process within {LIMIT:g} s")
            if os.read(self._read, 1)[0] == number:
                return


def _due(rank: int, step: int) -> bool:
    return rank == 1 and step == int(os.environ["STOP_AT"])


def _launcher() -> int:
    return int(os.environ["LAUNCHER_PID"])


def interrupt_this_rank(rank: int, step: int) -> None:
    """SIGINT to rank 1 alone: rank 0 learns of it only through the stop flag."""
    if _due(rank, step):
        os.kill(os.getpid(), signal.SIGINT)


def terminate_the_launcher(rank: int, step: int) -> None:
    """SIGTERM to the launcher alone (as ``kill PID`` does), which passes it on to the ranks;
    the step starts once it reached this rank."""
    if _due(rank, step):
        with SignalsSeen() as seen:
            os.kill(_launcher(), signal.SIGTERM)
            seen.wait_for(signal.SIGINT)


HANG = 60.0
"""Seconds the step of :func:`interrupt_the_launcher_twice` hangs unless the launcher ends
this rank first (as a stop at once does)."""


def interrupt_the_launcher_twice(rank: int, step: int) -> None:
    """Ctrl-C, and again once the launcher has passed the first on (it took it), while this
    step hangs: only a stop at once ends it before :data:`HANG`."""
    if _due(rank, step):
        with SignalsSeen() as seen:
            os.kill(_launcher(), signal.SIGINT)
            seen.wait_for(signal.SIGINT)
        os.kill(_launcher(), signal.SIGINT)
        threading.Event().wait(HANG)
