"""Waiting on communication with a timeout, and the few collectives a step needs.

Every wait goes through :func:`wait_work`, which turns a backend timeout or a
closed connection into :class:`PeerTimeoutError` / :class:`PeerFailedError`
naming this rank, where it was and the peer. In a single process world the
collectives are the identity.

A collective returns only once the backend has let go of its tensors
(:func:`complete`). A gloo worker thread wakes the caller when an operation is
done and drops its own reference to it a moment later. If Python has dropped
the operation's tensor by then, that last drop frees the tensor's Python
object, which takes the interpreter lock. After the last collective of a
script the interpreter may already be finalising; the thread is then ended
inside a destructor and the C++ runtime aborts the process ("terminate called
without an active exception", SIGABRT) after the rank's work is done. This
happens whether or not the group is destroyed: a group whose default group
object torch still holds (``torch.distributed.nn.functional`` keeps it in its
default arguments when imported after ``init_process_group``, as
``torch.distributed.checkpoint`` does) outlives ``destroy_process_group``.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from twobp.runtime.base.group import Membership, device_for
from twobp.runtime.errors import PeerFailedError, PeerTimeoutError

RELEASE_WAIT = 5.0
"""Seconds :func:`complete` waits at most for the backend to let go of a finished
operation's tensor (it takes microseconds unless the backend's thread is kept off
the CPU)."""

_RELEASE_POLL = 1e-4


def wait_work(
    work: Any, *, rank: int, peer: int | None, where: str, what: str, timeout: float
) -> None:
    """Wait for an asynchronous operation, at most ``timeout`` seconds.

    Args:
        work: the handle returned by an ``async_op`` call.
        rank: this rank (for the message).
        peer: the rank waited on, or None for a collective.
        where: what this rank was doing (``"at 1F3"``).
        what: what it waited for.
        timeout: seconds.

    Raises:
        PeerTimeoutError: if the operation did not finish in time.
        PeerFailedError: if the backend reported a failure (a closed connection).
    """
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise peer_error(
            exc, rank=rank, peer=peer, where=where, what=what, timeout=timeout
        ) from exc


def peer_error(
    exc: RuntimeError, *, rank: int, peer: int | None, where: str, what: str, timeout: float
) -> PeerTimeoutError | PeerFailedError:
    """The error to raise, from ``exc``, for a backend's failure while this rank posted or
    waited for ``what`` (arguments as :func:`wait_work`)."""
    who = f"rank {peer}" if peer is not None else "another rank"
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return PeerTimeoutError(
            f"rank {rank} {where} waited more than {timeout:g} s for {what} from {who}; "
            f"{who} is stuck, slow or gone. Check its log, or raise the pipeline's "
            "timeout if its work legitimately takes longer",
            rank,
            peer,
        )
    first_line = text.splitlines()[0] if text else type(exc).__name__
    return PeerFailedError(
        f"rank {rank} {where}: communication with {who} failed while waiting for {what} "
        f"({first_line}); {who} probably failed: see its error",
        rank,
        peer,
    )


def barrier(world: Membership, timeout: float, where: str) -> None:
    """Wait until every rank reaches this point."""
    if world.group is None:
        return
    work = dist.barrier(group=world.group, async_op=True)
    wait_work(work, rank=world.rank, peer=None, where=where, what="the barrier", timeout=timeout)


def broadcast(world: Membership, tensor: Tensor, src: int, timeout: float, what: str) -> Tensor:
    """``tensor`` of rank ``src`` on every rank (in place; returned for convenience)."""
    if world.group is None:
        return tensor
    root = world.global_rank(src)
    # The group is looked up when posted: no frame of a traceback may hold it (a pipeline
    # must not keep a destroyed group alive).
    complete(
        lambda: dist.broadcast(tensor, src=root, group=world.group, async_op=True),
        tensor,
        rank=world.rank,
        peer=src,
        where="at the end of the step",
        what=what,
        timeout=timeout,
    )
    return tensor


def all_reduce(
    world: Membership,
    tensor: Tensor,
    op: Any,
    timeout: float,
    what: str,
    *,
    where: str = "in a collective",
) -> Tensor:
    """Reduce ``tensor`` over all ranks, in place (``op``: a ``dist.ReduceOp``).

    ``where`` words a time-out.
    """
    if world.group is None:
        return tensor
    complete(
        lambda: dist.all_reduce(tensor, op=op, group=world.group, async_op=True),
        tensor,
        rank=world.rank,
        peer=None,
        where=where,
        what=what,
        timeout=timeout,
    )
    return tensor


def sum_small(
    world: Membership,
    tensor: Tensor,
    timeout: float,
    what: str,
    *,
    where: str = "in a collective",
) -> Tensor:
    """Sum a small ``tensor`` over all ranks, in place: :func:`all_reduce`, or between two
    gloo ranks a point-to-point exchange.

    Gloo's all-reduce of two ranks takes two rounds of messages (0.3-0.4 ms where the
    peer is already waiting); an exchange, each rank sending its tensor and adding the
    other's, takes one (0.1 ms). ``a + b`` and ``b + a`` are the same number, so both
    ranks hold the same sum, as after an all-reduce. What the start and the end of
    every step agree on goes this way.
    """
    if world.group is None:
        return tensor
    if world.size != 2 or tensor.device.type != "cpu" or "gloo" not in (world.backend or ""):
        return all_reduce(world, tensor, dist.ReduceOp.SUM, timeout, what, where=where)
    peer = 1 - world.rank
    other = torch.empty_like(tensor)
    held = (holders_of(tensor), holders_of(other))
    group = world.group
    try:  # a peer gone is seen as the messages are posted, as well as in the wait
        received = dist.irecv(other, group=group, tag=_EXCHANGE_TAG, group_src=peer)
        sent = dist.isend(tensor, group=group, tag=_EXCHANGE_TAG, group_dst=peer)
    except RuntimeError as exc:
        raise peer_error(
            exc, rank=world.rank, peer=peer, where=where, what=what, timeout=timeout
        ) from exc
    for work in (received, sent):
        wait_work(work, rank=world.rank, peer=peer, where=where, what=what, timeout=timeout)
    del received, sent, work
    wait_released(tensor, held[0])
    wait_released(other, held[1])
    return tensor.add_(other)


_EXCHANGE_TAG = 0x2B9
"""The tag of :func:`sum_small`'s messages: apart from any other point-to-point message on
the group."""


def all_gather_objects(world: Membership, value: Any, timeout: float = 300.0) -> list[Any]:
    """Each rank's ``value`` (picklable), indexed by rank.

    Two all-reduces of tensors this function holds (the sizes, then the
    bytes, each rank filling its own row of a zero table) instead of
    ``dist.all_gather_object``, whose own tensors are dropped as it returns
    (see the module's docstring).
    """
    if world.group is None:
        return [value]
    device = device_for(world)
    data = pickle.dumps(value)
    sizes = torch.zeros(world.size, dtype=torch.int64, device=device)
    sizes[world.rank] = len(data)
    all_reduce(world, sizes, dist.ReduceOp.SUM, timeout, "the sizes of the other ranks' values")
    lengths = sizes.tolist()
    table = torch.zeros(world.size, max(lengths), dtype=torch.uint8)
    table[world.rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    table = table.to(device)
    all_reduce(world, table, dist.ReduceOp.SUM, timeout, "the other ranks' values")
    rows = table.cpu()
    return [pickle.loads(bytes(rows[r, : lengths[r]].tolist())) for r in range(world.size)]


def complete(
    post: Callable[[], Any],
    tensor: Tensor,
    *,
    rank: int,
    peer: int | None,
    where: str,
    what: str,
    timeout: float,
) -> None:
    """Post a collective on ``tensor``, wait for it, and wait until the backend lets go of it.

    The caller still holds ``tensor`` when this returns, and the backend no
    longer does, so that no backend thread is ever left to free a tensor's
    Python object (see the module's docstring).

    Args:
        post: posts the operation (``async_op=True``) and returns its handle.
        tensor: the tensor the operation reads and writes.
        rank, peer, where, what, timeout: as :func:`wait_work`.

    Raises:
        PeerTimeoutError, PeerFailedError: as :func:`wait_work`.
    """
    holders = holders_of(tensor)
    work = post()
    wait_work(work, rank=rank, peer=peer, where=where, what=what, timeout=timeout)
    del work
    wait_released(tensor, holders)


def wait_released(tensor: Tensor, holders: int) -> None:
    """Wait (at most :data:`RELEASE_WAIT`) until ``tensor`` has no more holders than ``holders``.

    For a collective whose handle the caller has waited on and dropped: the
    backend's thread lets go of the tensor a moment after it wakes the caller.
    """
    deadline = time.monotonic() + RELEASE_WAIT
    while holders_of(tensor) > holders and time.monotonic() < deadline:
        time.sleep(_RELEASE_POLL)  # lets the backend's thread run


def holders_of(tensor: Tensor) -> int:
    """How many references to ``tensor``'s implementation exist (Python's counts once)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


def scalar(value: float, device: torch.device) -> Tensor:
    """A float64 0-dim tensor on ``device`` (what the collectives carry)."""
    return torch.tensor(value, dtype=torch.float64, device=device)
