"""The runtime's one piece of module state: what a process holds across its pipelines.

For the exit, the pipelines still open and the default group twobp created;
while it runs, the reduction groups made so far, which pipelines built one
after the other share (:func:`reduction_group`). All are held weakly, so that
this module never keeps a pipeline or a group alive (torch's registry owns the
groups until the world is destroyed).

Why the exit needs them: a gloo process group runs worker threads that drop
each finished operation, and with it the tensors it used; dropping a tensor
that Python also knows takes the interpreter lock. If the group is still alive
when the interpreter shuts down, such a thread finds the interpreter gone and
the C++ runtime aborts the process ("terminate called without an active
exception"), after the rank's work is done. So at exit, while the interpreter
still runs:

1. every pipeline still open is closed (:meth:`twobp.runtime.Pipeline.close`);
2. the default group is destroyed if twobp created it (from a launcher's
   environment); a group the caller created is the caller's to destroy, as
   torch asks (``destroy_process_group``).
"""

from __future__ import annotations

import atexit
import datetime
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch.distributed as dist


class Closeable(Protocol):
    """Anything with a ``close()`` that releases its communication."""

    def close(self) -> None: ...


_open: weakref.WeakSet[Closeable] = weakref.WeakSet()
_created_group: list[weakref.ref[dist.ProcessGroup]] = []
_made: dict[tuple[str, tuple[int, ...], float, bool], weakref.ref[dist.ProcessGroup]] = {}
"""The reduction groups and links made so far in this process, by key, global ranks, timeout
and whether every rank made them (held weakly: torch's registry owns them until the world is
destroyed)."""


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


def reduction_group(key: str, ranks: list[int], timeout: float) -> dist.ProcessGroup:
    """The process group of one reduction over ``ranks`` (global ranks), made once.

    Collective over ``ranks`` the first time: :func:`shared_group` under the
    reduction's key.
    """
    group = shared_group(key, ranks, timeout)
    assert group is not None, "a reduction group is made by its ranks only"
    return group


def shared_group(
    key: str, ranks: list[int], timeout: float, *, every_rank: bool = False
) -> dist.ProcessGroup | None:
    """The process group of ``key`` over ``ranks`` (global ranks), made once.

    Collective over ``ranks`` the first time (with ``every_rank``, over the
    whole world, every rank calling for every group: then torch names the
    groups by a count all ranks keep alike, not by the ranks and the number
    of groups the caller belongs to). Pipelines built one after the
    other (the trial pipelines of ``schedule="auto"``, then the one that
    runs) share the group of a reduction with the same key and ranks instead
    of each making one that lives until the world is destroyed. Their steps
    never overlap, and each waits for its reductions, so they never meet on
    it out of order. Every rank of ``ranks`` builds the same pipelines in the
    same order, so all find the group made, or all make it. (The links of
    the point-to-point transfers, one group per direction of each pair of
    neighbours, are shared in the same way:
    :mod:`twobp.runtime.communication.links`.)

    Returns:
        The group; None on a rank outside ``ranks`` (``every_rank`` only).
    """
    index = (key, tuple(ranks), timeout, every_rank)
    ref = _made.get(index)
    held = ref() if ref is not None else None
    if held is None:
        group = dist.new_group(
            ranks,
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=not every_rank,
        )
        member = isinstance(group, dist.ProcessGroup)
        # A rank outside the group remembers it for as long as the world lives.
        held = group if member else dist.group.WORLD
        assert held is not None
        _made[index] = weakref.ref(held)
        return group if member else None
    return held if dist.get_rank() in ranks else None


def mark_made(key: str, ranks: list[int], timeout: float) -> bool:
    """On a rank outside ``ranks``: remember that the group of ``key`` exists now.

    A rank that makes no group of a reduction still counts the groups the
    others made (:func:`even_out`). Returns True if it was new.
    """
    index = (key, tuple(ranks), timeout, False)
    ref = _made.get(index)
    if ref is not None and ref() is not None:
        return False
    world = dist.group.WORLD
    assert world is not None
    _made[index] = weakref.ref(world)
    return True


def even_out(made: Iterable[Iterable[int]], me: int, timeout: float) -> None:
    """One-rank groups so that ``me`` belongs to as many of the groups ``made`` as the most.

    torch names a group made with ``use_local_synchronization`` by its ranks and
    the number of groups the making rank belongs to: two ranks that belong to
    different numbers of groups would look for different names and wait for
    each other until the timeout. Every rank calls it with the same ``made``
    (global ranks of each group made since the ranks last agreed).
    """
    counts: dict[int, int] = {}
    for ranks in made:
        for rank in ranks:
            counts[rank] = counts.get(rank, 0) + 1
    for _ in range(max(counts.values(), default=0) - counts.get(me, 0)):
        dist.new_group(
            [me],
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=True,
        )


def is_made(key: str, ranks: list[int], timeout: float, *, every_rank: bool = False) -> bool:
    """True if :func:`shared_group` made this group before (and it still lives)."""
    ref = _made.get((key, tuple(ranks), timeout, every_rank))
    return ref is not None and ref() is not None


atexit.register(close_all)
