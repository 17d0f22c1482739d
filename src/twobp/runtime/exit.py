"""What the runtime does when the interpreter exits.

A gloo process group runs worker threads that drop each finished operation,
and with it the tensors it used; dropping a tensor that Python also knows
takes the interpreter lock. If the group is still alive when the interpreter
shuts down, such a thread finds the interpreter gone and the C++ runtime
aborts the process ("terminate called without an active exception"), after
the rank's work is done. So at exit, while the interpreter still runs:

1. every pipeline still open is closed (:meth:`twobp.runtime.Pipeline.close`);
2. the default group is destroyed if twobp created it (from a launcher's
   environment); a group the caller created is the caller's to destroy, as
   torch asks (``destroy_process_group``).

This is the one piece of module state of the runtime: the exit hook has to
find the open pipelines, and holds them weakly so that it never keeps one alive.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

import torch.distributed as dist


class Closeable(Protocol):
    """Anything with a ``close()`` that releases its communication."""

    def close(self) -> None: ...


_open: weakref.WeakSet[Closeable] = weakref.WeakSet()
_created_group: list[weakref.ref[dist.ProcessGroup]] = []


def close_at_exit(obj: Closeable) -> None:
    """Close ``obj`` at interpreter exit unless it is closed or gone by then."""
    _open.add(obj)


def forget(obj: Closeable) -> None:
    """Stop tracking ``obj`` (it closed itself)."""
    _open.discard(obj)


def destroy_at_exit(group: dist.ProcessGroup) -> None:
    """Destroy the default ``group`` at interpreter exit (twobp created it)."""
    _created_group.append(weakref.ref(group))


def close_all() -> None:
    """Close every open pipeline, then destroy the default group twobp created."""
    for obj in list(_open):
        obj.close()
    _open.clear()
    for ref in _created_group:
        group = ref()
        if group is not None and dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
    _created_group.clear()


atexit.register(close_all)
