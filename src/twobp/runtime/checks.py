"""Make every rank fail together, and check that all ranks built the same pipeline.

A problem that only one rank can see (its batch is missing, its checkpoint
file is bad) must not leave the others waiting on it. :func:`agree` is one
small all-reduce in which each rank says whether it found a problem; if any
did, every rank raises the same error class, with the message of the rank
that found it. It also carries a few integers per rank (batch sizes, step
counts), so checks that compare ranks cost nothing more.

:func:`check_same_pipeline` compares a fingerprint of each rank's blocks and
options at construction: a rank that built another model, or got other
options, would otherwise split the model differently and deadlock or fail with
a shape error far from the cause.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from twobp.runtime import collective
from twobp.runtime.errors import (
    CheckpointError,
    ModelMismatchError,
    NonFiniteLossError,
    PeerFailedError,
    PipelineConfigError,
    PipelineError,
    ShapeMismatchError,
)
from twobp.runtime.group import Membership
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

_SAMPLES_PER_TENSOR = 8

Details = Sequence[tuple[int, Mapping[str, str], list["BlockPrint"]]]
"""Per rank: the number of blocks, the options by name, the fingerprint of every block."""


class ValuesDifferWarning(UserWarning):
    """The ranks built blocks of the same structure but with different values."""


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
        peer = 1 - world.rank if world.size == 2 else None
        work = dist.all_reduce(tensor, group=world.group, async_op=True)
        collective.wait_work(
            work, rank=world.rank, peer=peer, where=where, what="the other ranks", timeout=timeout
        )
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
        peer = 1 - world.rank if size == 2 else None
        work = dist.all_reduce(tensor, group=world.group, async_op=True)
        collective.wait_work(
            work, rank=world.rank, peer=peer, where=where, what="the other ranks", timeout=timeout
        )
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


def nonfinite_error(
    world_rank: int, step: int, loss: float, microbatch: int, rank: int
) -> NonFiniteLossError:
    """The error for a step whose mean loss is not finite.

    Args:
        world_rank: this rank.
        step: the step index.
        loss: the mean loss.
        microbatch: the first micro-batch whose loss was not finite (-1: unknown).
        rank: the rank of the last stage, which computed the loss.
    """
    first = f"; micro-batch {microbatch} was the first" if microbatch >= 0 else ""
    return NonFiniteLossError(
        f"rank {world_rank}: the mean loss of step {step} is {loss} (computed on rank {rank}, "
        f"the last stage{first}). The step's gradients were dropped on every rank. Lower the "
        "learning rate, clip gradients, check the data and the loss for division by zero or "
        "log(0), use a wider dtype, or pass nonfinite='skip' to skip such steps",
        step,
        loss,
    )


# -- fingerprints of the model --------------------------------------------------------


@dataclass(frozen=True)
class BlockPrint:
    """What identifies one block: its structure and a sample of its values.

    Args:
        structure: a hash of the names, shapes, dtypes and gradient flags of
            its parameters and buffers, and its class name.
        values: a hash of a few values of every tensor.
        summary: a short description (class, parameter count), for messages.
    """

    structure: int
    values: int
    summary: str


def stable_hash(text: str | bytes) -> int:
    """A 62-bit hash of ``text``, the same in every process (unlike ``hash``)."""
    data = text.encode() if isinstance(text, str) else text
    # 62 bits: the sum of one row in an int64 all-reduce never overflows.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 2


def is_lazy(tensor: Tensor) -> bool:
    """True for a parameter or buffer of a lazy module that has no shape yet."""
    from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

    return isinstance(tensor, UninitializedTensorMixin)


def _sample(tensor: Tensor) -> str:
    if tensor.is_meta or is_lazy(tensor):
        return "?"
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return ""
    index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), _SAMPLES_PER_TENSOR))
    values = flat[index.long().to(flat.device)]
    if values.is_complex():
        values = torch.view_as_real(values)
    return repr(values.to("cpu", torch.float64).tolist())


def block_print(block: nn.Module) -> BlockPrint:
    """The fingerprint of one block (cheap: a few values per tensor)."""
    structure = [type(block).__qualname__]
    values = []
    n_params = 0
    tensors = [*block.named_parameters(), *block.named_buffers()]
    for name, tensor in tensors:
        if is_lazy(tensor):
            structure.append(f"{name}:uninitialized")
            continue
        grad = int(tensor.requires_grad)
        structure.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{grad}")
        values.append(_sample(tensor))
        n_params += tensor.numel() if isinstance(tensor, nn.Parameter) else 0
    summary = f"{type(block).__name__} with {n_params:,} parameters in {len(tensors)} tensors"
    return BlockPrint(stable_hash("|".join(structure)), stable_hash("|".join(values)), summary)


def check_same_pipeline(
    world: Membership,
    device: torch.device,
    timeout: float,
    problem: Exception | None,
    options: Mapping[str, str],
    blocks: Sequence[nn.Module],
) -> None:
    """Raise on every rank if any rank has a problem, other options or another model.

    Collective. One all-reduce of five integers per rank; the fingerprints
    themselves are exchanged only when they differ.

    Args:
        world: the group.
        device: where the all-reduce runs.
        timeout: seconds to wait for the other ranks.
        problem: this rank's configuration error so far, or None.
        options: every option that must be the same on every rank, by name.
        blocks: this rank's copy of the whole model.

    Raises:
        PipelineConfigError: ``problem`` of any rank, on every rank.
        ModelMismatchError: if the options or the blocks' structure differ,
            naming the ranks and the first block that differs.

    Warns:
        ValuesDifferWarning: if the blocks have the same structure but other
            values (the model was not seeded alike on every rank).
    """
    prints = [block_print(b) for b in blocks] if problem is None else []
    numbers = [
        len(blocks),
        stable_hash(repr(sorted(options.items()))),
        stable_hash(repr([p.structure for p in prints])),
        stable_hash(repr([p.values for p in prints])),
    ]
    table = agree(world, device, timeout, problem, "building the pipeline", numbers)
    if all(row == table[0] for row in table):
        return
    details = collective.all_gather_objects(world, (len(blocks), dict(options), prints))
    message = describe_difference(details)
    if message is not None:
        raise ModelMismatchError(message)
    rank, block = _first_value_difference(details)
    warnings.warn(
        f"rank {world.rank}: block {block} has other values on rank {rank} than on rank 0 "
        "(same shapes). Each rank keeps only its own blocks, so training works, but the model "
        "is not the one a single process would build: seed the model's construction alike on "
        "every rank (torch.manual_seed before building it) or load a checkpoint",
        ValuesDifferWarning,
        stacklevel=4,
    )


def describe_difference(details: Details) -> str | None:
    """What differs between the ranks' block structures or options (None: nothing).

    Args:
        details: per rank, the number of blocks, the options by name and the
            fingerprint of every block.
    """
    n0, options0, prints0 = details[0]
    for rank, (n, options, prints) in enumerate(details[1:], start=1):
        if n != n0:
            return (
                f"rank 0 built a model of {n0} blocks and rank {rank} one of {n}; every rank "
                "must build the same whole model (each keeps only its own blocks)"
            )
        for i, (a, b) in enumerate(zip(prints0, prints, strict=True)):
            if a.structure != b.structure:
                return (
                    f"block {i} differs between rank 0 ({a.summary}) and rank {rank} "
                    f"({b.summary}): its parameters or buffers have other names, shapes or "
                    "dtypes; every rank must build the same whole model"
                )
        differ = [k for k in options0 if options0[k] != options.get(k)]
        if differ:
            shown = "; ".join(
                f"{k} {options0[k]} on rank 0, {options.get(k)} on rank {rank}" for k in differ
            )
            return (
                f"the ranks were given different pipeline options ({shown}); pass the same "
                "schedule, micro-batches, partition and 2BP options on every rank"
            )
    return None


def _first_value_difference(details: Details) -> tuple[int, int]:
    prints0 = details[0][2]
    for rank, (_, _, prints) in enumerate(details[1:], start=1):
        for i, (a, b) in enumerate(zip(prints0, prints, strict=True)):
            if a.values != b.values:
                return rank, i
    return 0, 0
