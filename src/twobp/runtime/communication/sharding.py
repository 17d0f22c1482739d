"""Flat buckets cut over the ranks that hold them, and the gathers that make them whole.

With a sharded optimizer (:meth:`twobp.runtime.Pipeline.shard_optimizer`,
ZeRO-1), each bucket of replicated parameters is one flat buffer, padded to a
multiple of the ranks that hold it. At ``R`` the ranks reduce-scatter the
bucket's gradients, so that each ends with the sum of its own contiguous
shard (:class:`ShardLayout` says which); each steps its shard; then
:class:`ParameterGathers` all-gathers the updated shards back into the flat
buffer, which the parameters are views of, in the background, in the order
in which the rank's forwards read them. Each block of a stage waits for the
gathers of its own parameters just before it runs (a forward pre-hook, as
FSDP prefetches), so a stage's first forward computes its first blocks while
the gathers of the later ones are still running; parameters outside such a
block are waited for before the stage's forward.

Every rank builds the same layout from the same parameters in the same order
(the order of the stages' ``R`` in the schedule), so the shards match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

from twobp.runtime.communication.collective import holders_of, wait_released, wait_work


@dataclass(frozen=True)
class ShardLayout:
    """How one flat bucket of parameters is cut over the ranks that hold it.

    Args:
        numels: the number of elements of each parameter, in bucket order.
        ranks: how many ranks hold the bucket (the size of its group).
        index: this rank's position among them (its rank in the group).

    Raises:
        ValueError: if ``index`` is not one of ``ranks`` positions.
    """

    numels: tuple[int, ...]
    ranks: int
    index: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.ranks:
            raise ValueError(f"shard {self.index} of a bucket cut in {self.ranks}")

    @property
    def total(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(self.numels)

    @property
    def padded(self) -> int:
        """Elements of the flat buffer: the total rounded up to a multiple of ``ranks``."""
        return -(-self.total // self.ranks) * self.ranks

    @property
    def size(self) -> int:
        """Elements of one shard."""
        return self.padded // self.ranks

    @property
    def start(self) -> int:
        """Where this rank's shard starts in the flat buffer."""
        return self.index * self.size

    @property
    def stop(self) -> int:
        """Where it ends (exclusive)."""
        return self.start + self.size

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer."""
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    def pieces(self) -> list[tuple[int, int, int]]:
        """The parts of parameters in this rank's shard: ``(parameter, first, stop)``,
        elements ``first:stop`` of the flattened parameter, in shard order."""
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            first, stop = max(self.start, offset), min(self.stop, offset + n)
            if first < stop:
                out.append((i, first - offset, stop - offset))
        return out


@dataclass
class _Gather:
    flat: Tensor
    shard: Tensor
    work: Any
    holders: tuple[int, int]
    stages: frozenset[int]
    what: str
    index: int


class ParameterGathers:
    """The all-gathers of updated shards in flight, waited for stage by stage.

    Args:
        rank: this rank (for messages).
        timeout: seconds to wait for the other ranks.
    """

    def __init__(self, rank: int, timeout: float) -> None:
        self._rank = rank
        self._timeout = timeout
        self._running: list[_Gather] = []

    @property
    def in_flight(self) -> bool:
        """True while some gather has not been waited for."""
        return bool(self._running)

    def start(
        self,
        flat: Tensor,
        shard: Tensor,
        group: dist.ProcessGroup,
        stages: Iterable[int],
        what: str,
        index: int = 0,
    ) -> None:
        """Gather every rank's ``shard`` into ``flat`` in the background.

        Args:
            flat: the padded flat buffer (the parameters are views of it).
            shard: this rank's updated shard, a tensor of its own.
            group: the ranks that hold the bucket.
            stages: this rank's stages whose forward waits for the whole
                bucket before it starts.
            what: what the bucket holds (for messages).
            index: the bucket's number, for :meth:`wait_shards`.
        """
        holders = (holders_of(flat), holders_of(shard))
        work = dist.all_gather_single(flat, shard, group=group, async_op=True)
        self._running.append(_Gather(flat, shard, work, holders, frozenset(stages), what, index))

    def wait(self, stage: int | None = None) -> None:
        """Wait for the gathers that ``stage``'s forward waits for (None: all of them).

        Raises:
            PeerError: if a peer does not take part in time.
        """
        if stage is None:
            self._wait(lambda _: True, "between steps")
        else:
            self._wait(lambda g: stage in g.stages, "before a forward")

    def wait_shards(self, indices: frozenset[int]) -> None:
        """Wait for the gathers of the buckets numbered ``indices`` (a block's own).

        Raises:
            PeerError: if a peer does not take part in time.
        """
        self._wait(lambda g: g.index in indices, "before a block's forward")

    def _wait(self, chosen: Callable[[_Gather], bool], where: str) -> None:
        keep = []
        running, self._running = self._running, []
        try:
            while running:
                gather = running.pop(0)
                if not chosen(gather):
                    keep.append(gather)
                    continue
                wait_work(
                    gather.work,
                    rank=self._rank,
                    peer=None,
                    where=where,
                    what=f"the gather of the updated parameters of {gather.what}",
                    timeout=self._timeout,
                )
                gather.work = None
                wait_released(gather.flat, gather.holders[0])
                wait_released(gather.shard, gather.holders[1])
        finally:
            self._running = keep + running

    def abandon(self) -> None:
        """Forget the gathers without waiting (a peer is gone, the pipeline closes)."""
        self._running = []
