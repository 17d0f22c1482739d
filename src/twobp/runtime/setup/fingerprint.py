"""Check that all ranks built the same pipeline: a fingerprint of every block and option.

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
from torch import Tensor, nn

from twobp.runtime.base.group import Membership
from twobp.runtime.communication import collective
from twobp.runtime.communication.agreement import agree
from twobp.runtime.errors import ModelMismatchError

_SAMPLES_PER_TENSOR = 8

Details = Sequence[tuple[int, Mapping[str, str], list["BlockPrint"]]]
"""Per rank: the number of blocks, the options by name, the fingerprint of every block."""


class ValuesDifferWarning(UserWarning):
    """The ranks built blocks of the same structure but with different values."""


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
