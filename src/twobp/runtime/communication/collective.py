"""Waiting on communication with a timeout, and the few collectives a step needs.

Every wait goes through :func:`wait_work`, which turns a backend timeout or a
closed connection into :class:`PeerTimeoutError` / :class:`PeerFailedError`
naming this rank, where it was and the peer. In a single process world the
collectives are the identity.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from twobp.runtime.errors import PeerFailedError, PeerTimeoutError
from twobp.runtime.setup.group import Membership


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
    who = f"rank {peer}" if peer is not None else "another rank"
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise PeerTimeoutError(
                f"rank {rank} {where} waited more than {timeout:g} s for {what} from {who}; "
                f"{who} is stuck, slow or gone. Check its log, or raise the pipeline's "
                "timeout if its work legitimately takes longer",
                rank,
                peer,
            ) from exc
        first_line = text.splitlines()[0] if text else type(exc).__name__
        raise PeerFailedError(
            f"rank {rank} {where}: communication with {who} failed while waiting for {what} "
            f"({first_line}); {who} probably failed: see its error",
            rank,
            peer,
        ) from exc


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
    work = dist.broadcast(tensor, src=world.global_rank(src), group=world.group, async_op=True)
    wait_work(
        work, rank=world.rank, peer=src, where="at the end of the step", what=what, timeout=timeout
    )
    return tensor


def all_reduce(world: Membership, tensor: Tensor, op: Any, timeout: float, what: str) -> Tensor:
    """Reduce ``tensor`` over all ranks, in place (``op``: a ``dist.ReduceOp``)."""
    if world.group is None:
        return tensor
    work = dist.all_reduce(tensor, op=op, group=world.group, async_op=True)
    wait_work(work, rank=world.rank, peer=None, where="in a collective", what=what, timeout=timeout)
    return tensor


def all_gather_objects(world: Membership, value: Any) -> list[Any]:
    """Each rank's ``value`` (picklable), indexed by rank."""
    if world.group is None:
        return [value]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value, group=world.group)
    return out


def scalar(value: float, device: torch.device) -> Tensor:
    """A float64 0-dim tensor on ``device`` (what the collectives carry)."""
    return torch.tensor(value, dtype=torch.float64, device=device)
