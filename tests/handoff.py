"""Points that one process reaches and another waits for, to order work across processes.

A test that needs a race to happen (rank 1 acts only once rank 0 is inside some call)
names the point: the process that gets there calls :meth:`Handoff.reach`, the one that
must wait calls :meth:`Handoff.wait_for`. The points are keys of a
``torch.distributed.FileStore`` in a folder of the test, so the order is set by the
processes themselves, not by a sleep. The wait's limit only ends a test whose order broke
(the point is never reached); it decides nothing when the code works.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch.distributed as dist

LIMIT = 60.0
"""Seconds :meth:`Handoff.wait_for` waits before it calls the point unreached."""


class Handoff:
    """Named points in a store under ``folder``, shared by every process that opens it.

    Args:
        folder: a folder of the test, the same for every process.
        limit: seconds a wait may last before the point counts as never reached.
    """

    def __init__(self, folder: str | Path, limit: float = LIMIT) -> None:
        self._store = dist.FileStore(str(Path(folder) / "handoff.store"), -1)
        self.limit = limit

    def reach(self, point: str) -> None:
        """Say that this process got to ``point``."""
        self._store.set(point, "reached")

    def reached(self, point: str) -> bool:
        """True if some process got to ``point`` (without waiting)."""
        return bool(self._store.check([point]))

    def wait_for(self, point: str) -> None:
        """Wait until some process got to ``point``.

        Raises:
            AssertionError: if none did within :attr:`limit` seconds (the order the test
                expects did not happen: a process waits where it should have gone on).
        """
        try:
            self._store.wait([point], datetime.timedelta(seconds=self.limit))
        except RuntimeError as exc:
            raise AssertionError(
                f"no process reached {point!r} within {self.limit:g} s: the process that "
                "should have got there waits on this one"
            ) from exc
