"""Step hooks of ``twobp train`` that send stop signals from inside a run (see test_train_stopping).

Each runs on every local rank before each step (``on_step``); it acts on rank
1 before step ``STOP_AT`` (an environment variable, which the ranks inherit).
The launcher is the process named by ``LAUNCHER_PID`` (the test's own): a rank
forked by launch's server is not the launcher's child.
"""

from __future__ import annotations

import os
import signal
import time


def _due(rank: int, step: int) -> bool:
    return rank == 1 and step == int(os.environ["STOP_AT"])


def _launcher() -> int:
    return int(os.environ["LAUNCHER_PID"])


def interrupt_this_rank(rank: int, step: int) -> None:
    """SIGINT to rank 1 alone: rank 0 learns of it only through the stop flag."""
    if _due(rank, step):
        os.kill(os.getpid(), signal.SIGINT)


def terminate_the_launcher(rank: int, step: int) -> None:
    """SIGTERM to the launcher alone (as ``kill PID`` does), which passes it on to the ranks."""
    if _due(rank, step):
        os.kill(_launcher(), signal.SIGTERM)
        time.sleep(2.0)  # the forwarded signal arrives while this step is in flight


def interrupt_the_launcher_twice(rank: int, step: int) -> None:
    """Ctrl-C, and again a second later, while a step hangs for a minute."""
    if _due(rank, step):
        os.kill(_launcher(), signal.SIGINT)
        time.sleep(1.0)
        os.kill(_launcher(), signal.SIGINT)
        time.sleep(60.0)
