"""Checkpoints written in the background: at most one per pipeline at a time.

The tensors are copied when the write starts (DCP's ``async_save``), so
training goes on at once. The write's collectives run in a gloo group of their
own, made at the first background write, so that they never interleave with
the training's. When DCP's coordinator (rank 0) has written its metadata,
every rank's data is in place: rank 0 then completes the checkpoint (writes the
manifest, renames the folder), in the writing thread. The next ``save``,
``load`` or ``wait_for_checkpoint`` collects the outcome on every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from twobp.runtime.base.group import Membership
from twobp.runtime.errors import CheckpointError

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage


@dataclass
class BackgroundWrite:
    """A checkpoint being written in the background."""

    future: Future[Any]
    final: Path
    """Where the checkpoint goes once complete."""
    completed: threading.Event = field(default_factory=threading.Event)
    error: CheckpointError | None = None
    """Rank 0's failure to complete the checkpoint."""

    def outcome(self, rank: int) -> CheckpointError | None:
        """Wait for the write (and its completion); this rank's problem, if any."""
        problem: CheckpointError | None = None
        try:
            self.future.result()
        except storage.FAILURES as exc:
            problem = storage.own_error(exc, rank, "cannot write its part of the checkpoint")
        self.completed.wait()
        return problem or self.error


@dataclass
class BackgroundSaves:
    """A pipeline's checkpoint writes in the background: at most one at a time."""

    group: dist.ProcessGroup | None = None
    """The group of their collectives (made at the first background write)."""
    pending: BackgroundWrite | None = None
    """The write in flight, until its outcome is collected."""

    def start(
        self,
        world: Membership,
        timeout: float,
        tensors: dict[str, Tensor],
        partial: Path,
        final: Path,
        complete: Callable[[], None] | None,
    ) -> None:
        """Copy ``tensors`` and write them into ``partial`` in the background. Collective.

        Args:
            world: the ranks that save together.
            timeout: seconds the write's collectives wait for a peer.
            tensors: this rank's tensors.
            partial: the checkpoint's folder while it is written.
            final: where it goes once complete.
            complete: called once every rank's data is written (on rank 0:
                write the manifest and move the folder into place); None elsewhere.
        """
        if self.pending is not None:
            raise CheckpointError("a checkpoint is still being written: wait for it first")
        if self.group is None and world.group is not None:
            self.group = storage.background_group(world, timeout)
        future = storage.write(tensors, partial, self.group, background=True)
        assert future is not None
        pending = BackgroundWrite(future, final)

        def on_written(done: Future[Any]) -> None:
            try:
                if complete is not None and not done.cancelled() and done.exception() is None:
                    complete()
            except (OSError, RuntimeError) as exc:
                pending.error = storage.checkpoint_error(exc, f"cannot complete {final}")
            finally:
                pending.completed.set()

        future.add_done_callback(on_written)
        self.pending = pending
