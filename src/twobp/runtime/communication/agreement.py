"""Make every rank fail together.

A problem that only one rank can see (its batch is missing, its checkpoint
file is bad) must not leave the others waiting on it. :func:`agree` is one
small sum over the ranks (:func:`twobp.runtime.communication.collective.sum_small`: an
all-reduce, or between two gloo ranks a point-to-point exchange) in which each rank says
whether it found a problem; if any did, every rank raises the same error class, with the
message of the rank that found it. It also carries a few integers per rank (batch sizes, step
counts), so checks that compare ranks cost nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from twobp.runtime.base.group import Membership
from twobp.runtime.communication import collective
from twobp.runtime.errors import (
    CheckpointError,
    ModelMismatchError,
    PeerFailedError,
    PipelineConfigError,
    PipelineError,
    ShapeMismatchError,
)
from twobp.schedule import ScheduleError

_SHARED_CLASSES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        PipelineConfigError,
        ModelMismatchError,
        CheckpointError,
        ShapeMismatchError,
        PipelineError,
        ScheduleError,
    )
}
"""Error classes a peer's problem is raised as, by name (others become PeerFailedError)."""


def agree(
    world: Membership,
    device: torch.device,
    timeout: float,
    problem: Exception | None,
    where: str,
    numbers: Sequence[int] = (),
) -> list[list[int]]:
    """Share whether any rank has a problem, and a few integers of every rank.

    Collective: every rank calls it with as many ``numbers``. Costs one
    all-reduce of ``size * (1 + len(numbers))`` integers; only when a rank
    reports a problem do the ranks also exchange the messages. (The start of
    every step uses the cheaper :func:`agree_small`.)

    Args:
        world: the group.
        device: where the all-reduce runs (the backend's device).
        timeout: seconds to wait for the other ranks.
        problem: this rank's problem, or None.
        where: what the ranks were doing, for time-out messages.
        numbers: this rank's integers to share (non-negative and below 2**62).

    Returns:
        Every rank's ``numbers``, indexed by rank.

    Raises:
        Exception: ``problem`` itself on the rank that found it; on the others,
            an error of the same class (if it is a pipeline error, else
            :class:`PeerFailedError`) whose message names the rank.
        PeerTimeoutError: if a rank does not arrive within ``timeout``.
    """
    row = [0 if problem is None else 1, *numbers]
    if world.group is None:
        table = [row]
    else:
        tensor = torch.zeros(world.size, len(row), dtype=torch.int64)
        tensor[world.rank] = torch.tensor(row, dtype=torch.int64)
        tensor = tensor.to(device)
        collective.sum_small(world, tensor, timeout, "the other ranks", where=where)
        table = tensor.cpu().tolist()
    if any(r[0] for r in table):
        _raise_shared(world, problem)
    return [r[1:] for r in table]


SMALL_BITS = 30
"""Bits of the number each rank shares in :func:`agree_small`."""

_SLOT_BITS = SMALL_BITS + 1
_RANKS_PER_INTEGER = 2


def agree_small(
    world: Membership,
    device: torch.device,
    timeout: float,
    problem: Exception | None,
    where: str,
    value: int,
    buffer: Tensor | None = None,
) -> list[int]:
    """:func:`agree` for one number below ``2**SMALL_BITS`` per rank, at the least cost.

    Two ranks share each 62-bit integer of the all-reduce, so 2 ranks reduce a
    single integer: under gloo, as cheap as the barrier it replaces at the start
    of a step (an all-reduce of a few integers per rank costs more).

    Args:
        world: the group.
        device: where the all-reduce runs (the backend's device).
        timeout: seconds to wait for the other ranks.
        problem: this rank's problem, or None.
        where: what the ranks were doing, for time-out messages.
        value: this rank's number, in ``[0, 2**SMALL_BITS)``.
        buffer: an int64 tensor of :func:`small_buffer_size` elements on
            ``device`` (see :func:`small_buffer`) to reuse from call to call:
            gloo reduces a tensor it has seen before faster than a new one.

    Returns:
        Every rank's ``value``, indexed by rank.

    Raises:
        Exception: as :func:`agree`.
    """
    if not 0 <= value < 1 << SMALL_BITS:
        raise ValueError(f"agree_small takes values in [0, 2**{SMALL_BITS}), got {value}")
    slot = (value << 1) | (0 if problem is None else 1)
    if world.group is None:
        slots = [slot]
    else:
        size = world.size
        tensor = buffer if buffer is not None else small_buffer(world.size, device)
        tensor.zero_()
        shift = _SLOT_BITS * (world.rank % _RANKS_PER_INTEGER)
        tensor[world.rank // _RANKS_PER_INTEGER] = slot << shift
        collective.sum_small(world, tensor, timeout, "the other ranks", where=where)
        packed = tensor.cpu().tolist()
        mask = (1 << _SLOT_BITS) - 1
        slots = [
            (packed[r // _RANKS_PER_INTEGER] >> (_SLOT_BITS * (r % _RANKS_PER_INTEGER))) & mask
            for r in range(size)
        ]
    if any(s & 1 for s in slots):
        _raise_shared(world, problem)
    return [s >> 1 for s in slots]


def small_buffer(world_size: int, device: torch.device) -> Tensor:
    """A buffer for :func:`agree_small` in a group of ``world_size`` ranks."""
    return torch.zeros(-(-world_size // _RANKS_PER_INTEGER), dtype=torch.int64, device=device)


def _raise_shared(world: Membership, problem: Exception | None) -> None:
    """Raise the problem of the first rank that had one, on every rank."""
    mine = None if problem is None else (type(problem).__name__, str(problem))
    reports = collective.all_gather_objects(world, mine)
    if problem is not None:
        cls = _SHARED_CLASSES.get(type(problem).__name__)
        if cls is type(problem) and not str(problem).startswith("rank "):
            raise cls(f"rank {world.rank}: {problem}") from problem
        raise problem
    failed = [(r, report) for r, report in enumerate(reports) if report is not None]
    rank, (name, message) = failed[0]
    others = [r for r, _ in failed[1:]]
    also = f" (ranks {', '.join(map(str, others))} reported problems too)" if others else ""
    text = f"rank {rank} reported: {message}{also}"
    cls = _SHARED_CLASSES.get(name)
    if cls is None:
        raise PeerFailedError(f"{text} [{name}]", world.rank, rank)
    raise cls(text)
