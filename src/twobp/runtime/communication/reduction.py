"""The gradient reduction of replicated stages: the ``R`` action of the schedule.

At its stage's ``R`` (right after the stage's last ``W`` or ``B``), this rank
starts an asynchronous all-reduce of that stage's weight gradients over the
ranks that hold the same parameters, one flat bucket of at most
:data:`BUCKET_BYTES` at a time, and goes on with its other stages' work. At
the end of the step it waits for every bucket and writes the sums back,
divided by the number of data-parallel replicas: each replica's loss is the
mean over its own micro-batches, and the global loss is their mean. The
floating-point buffers of a replicated stage (BatchNorm's running
statistics, which each replica updates on its own micro-batches) are
averaged over its replicas at the same time, so that the replicas stay one
model.

A parameter used by several stages of this rank (a tied embedding and head)
is reduced once, at the ``R`` of the last of them in this rank's order. When
a step fails part-way, :meth:`GradientReducer.drain` starts the reductions
not started yet, so that no peer waits for this rank in an all-reduce.

With a sharded optimizer (:meth:`GradientReducer.scatter`), a bucket of
parameters is reduce-scattered instead: each rank receives the sum of its
own shard of the flat bucket (:class:`~twobp.runtime.communication.sharding.ShardLayout`),
and the parameters' full gradients are dropped once copied into the bucket.
With sharded parameters a stage's gradients may be reduce-scattered after
each of its ``W`` instead (:meth:`GradientReducer.scatter_now`, see
:mod:`twobp.schedule.gradient_scatter`): each reduce-scatter runs in the
background (gloo progresses it on its own threads), its flat bucket is let
go of as soon as it is complete (:meth:`GradientReducer.reap`, asked after
every action, without waiting) and its shard is added to the others at the
end of the step.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from twobp.runtime.communication.collective import holders_of, wait_released, wait_work
from twobp.runtime.communication.sharding import ShardLayout
from twobp.runtime.errors import PipelineClosedError

BUCKET_BYTES = 25 * 2**20
"""The largest flat bucket of gradients one all-reduce carries (as DDP's default)."""


@dataclass(frozen=True)
class Bucket:
    """Gradients reduced by one all-reduce.

    Args:
        key: the reduction group's key (for messages).
        group: the process group, held weakly (its owner destroys it).
        parameters: the parameters whose gradients it carries, in order.
        buffers: floating-point buffers (BatchNorm's running statistics) it
            averages over the group's ranks instead, after the gradients.
    """

    key: str
    group: weakref.ref[dist.ProcessGroup]
    parameters: tuple[nn.Parameter, ...]
    buffers: tuple[Tensor, ...] = ()

    @property
    def tied(self) -> bool:
        """True for a weight tied across stages (key ``"tied <name>"``): its holders reduce it
        at the ``R`` of different stages, whose ``W`` they may list in different numbers, so
        it is reduce-scattered at that ``R`` only, never after each ``W``."""
        return self.key.startswith("tied ")

    def process_group(self, rank: int) -> dist.ProcessGroup:
        """The live process group.

        Raises:
            PipelineClosedError: naming ``rank``, if the group was destroyed since.
        """
        group = self.group()
        if group is None:
            raise PipelineClosedError(
                f"rank {rank}: the process group of {self.key} was destroyed; "
                "build a new Pipeline to go on"
            )
        return group


@dataclass
class _Running:
    """One reduction in flight: its bucket, the flat tensor sent (None once let go of),
    the backend's handle (None once waited for), and for a reduce-scatter its shard;
    the references each had when posted."""

    bucket: Bucket
    flat: Tensor | None
    work: Any
    holders: int
    shard: Tensor | None = None
    shard_holders: int = 0


class ShardSink(Protocol):
    """Where a reduce-scattered bucket's shard goes: ``sink(shard)``, already averaged;
    called once per reduce-scatter of the step (several when a stage's gradients are
    reduce-scattered after each ``W``), whose shards add up."""

    def __call__(self, shard: Tensor) -> None: ...


def buckets(
    key: str,
    group: dist.ProcessGroup,
    parameters: Sequence[nn.Parameter],
    buffers: Sequence[Tensor] = (),
) -> list[Bucket]:
    """``parameters`` cut into buckets of at most :data:`BUCKET_BYTES` and of one dtype
    and device each, and one of ``buffers``."""
    out: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in parameters:
        nbytes = p.numel() * p.element_size()
        other = bool(out[-1]) and (out[-1][0].dtype, out[-1][0].device) != (p.dtype, p.device)
        if out[-1] and (size + nbytes > BUCKET_BYTES or other):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    ref = weakref.ref(group)
    made = [Bucket(key, ref, tuple(chunk)) for chunk in out if chunk]
    if buffers:
        made.append(Bucket(key, ref, (), tuple(buffers)))
    return made


class GradientReducer:
    """This rank's gradient reductions of one pipeline, step after step.

    Args:
        rank: this rank (for messages).
        by_stage: the buckets to start at each stage's ``R``.
        divisor: what the sums are divided by (the data-parallel degree).
        timeout: seconds to wait for the other ranks.
    """

    def __init__(
        self,
        rank: int,
        by_stage: Mapping[int, Sequence[Bucket]],
        divisor: int,
        timeout: float,
    ) -> None:
        self._rank = rank
        self._by_stage = {s: tuple(b) for s, b in by_stage.items()}
        self._divisor = divisor
        self._timeout = timeout
        self._started: set[int] = set()
        self._running: list[_Running] = []
        self._scatter: dict[int, tuple[ShardLayout, ShardSink]] = {}

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages that reduce something on this rank."""
        return tuple(s for s, b in self._by_stage.items() if b)

    @property
    def by_stage(self) -> dict[int, tuple[Bucket, ...]]:
        """The buckets started at each stage's ``R``."""
        return dict(self._by_stage)

    @property
    def divisor(self) -> int:
        """What the sums are divided by (the data-parallel degree)."""
        return self._divisor

    @property
    def started(self) -> frozenset[int]:
        """The stages whose ``R`` started in this step."""
        return frozenset(self._started)

    def scatter(self, bucket: Bucket, layout: ShardLayout, sink: ShardSink) -> None:
        """Reduce-scatter ``bucket`` from now on: its shard ``layout`` goes to ``sink``
        at the end of each step, and its parameters' gradients are dropped at ``R``."""
        self._scatter[id(bucket)] = (layout, sink)

    @property
    def scatters(self) -> bool:
        """True if some bucket is reduce-scattered (a sharded optimizer)."""
        return bool(self._scatter)

    def start(self, stage: int, gradients: bool = True) -> None:
        """Start the all-reduces of ``stage``'s buckets (the ``R`` action).

        Args:
            gradients: False: leave out the buckets that are reduce-scattered, whose
                gradients were reduce-scattered after each ``W`` already
                (:meth:`scatter_now`; a tied weight's are not, see :attr:`Bucket.tied`).
        """
        if stage in self._started:
            raise RuntimeError(f"rank {self._rank}: R of stage {stage} ran twice in one step")
        self._started.add(stage)
        for bucket in self._by_stage.get(stage, ()):
            group = bucket.process_group(self._rank)
            sharded = self._scatter.get(id(bucket))
            if sharded is not None:
                if gradients or bucket.tied:
                    self._start_scatter(bucket, sharded[0], group)
                continue
            tensors = [_grad(p) for p in bucket.parameters] or list(bucket.buffers)
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            work = dist.all_reduce(flat, group=group, async_op=True)
            self._running.append(_Running(bucket, flat, work, holders_of(flat)))

    def scatter_now(self, stage: int) -> int:
        """Start reduce-scattering the gradients ``stage``'s parameters hold now (a ``W``
        just ran), dropping them; what each rank receives is added to its shard at the
        end of the step. Returns the bytes of whole gradients the reduce-scatters hold
        until they complete (:meth:`reap`)."""
        nbytes = 0
        for bucket in self._by_stage.get(stage, ()):
            sharded = self._scatter.get(id(bucket))
            if sharded is not None and not bucket.tied:
                flat = self._start_scatter(bucket, sharded[0], bucket.process_group(self._rank))
                nbytes += flat.numel() * flat.element_size()
        return nbytes

    def _start_scatter(self, bucket: Bucket, layout: ShardLayout, group: Any) -> Tensor:
        flat, shard = _flat_gradients(bucket, layout)
        holders = holders_of(flat)
        shard_holders = holders_of(shard)
        work = dist.reduce_scatter_single(shard, flat, group=group, async_op=True)
        self._running.append(_Running(bucket, flat, work, holders, shard, shard_holders))
        return flat

    def reap(self) -> None:
        """Let go of the whole gradients of every reduce-scatter already complete (without
        waiting for the others): only their shards are kept until the end of the step."""
        for running in self._running:
            if running.shard is None or running.flat is None:
                continue
            if not running.work.is_completed():
                continue
            self._wait(running, "after a W")
            running.flat = None

    def _wait(self, running: _Running, where: str) -> None:
        if running.work is None:
            return
        wait_work(
            running.work,
            rank=self._rank,
            peer=None,
            where=where,
            what=f"the gradient reduction of {running.bucket.key}",
            timeout=self._timeout,
        )
        # Gloo's thread lets go of the bucket a moment after the wait: no thread of
        # the backend may be left to free it (see twobp.runtime.communication.collective).
        running.work = None
        if running.flat is not None:
            wait_released(running.flat, running.holders)
        if running.shard is not None:
            wait_released(running.shard, running.shard_holders)

    @property
    def scattering_bytes(self) -> int:
        """Bytes of whole gradients held by reduce-scatters not yet let go of."""
        return sum(
            r.flat.numel() * r.flat.element_size()
            for r in self._running
            if r.shard is not None and r.flat is not None
        )

    def drain(self) -> None:
        """Start every reduction not started in this step (after a failure)."""
        for stage in self._by_stage:
            if stage not in self._started:
                self.start(stage)

    def finish(self, keep: bool = True) -> None:
        """Wait for every reduction of the step; with ``keep``, write the results back.

        Raises:
            PeerError: if a peer does not take part in time.
        """
        running, self._running = self._running, []
        self._started.clear()
        running.reverse()
        while running:
            r = running.pop()
            self._wait(r, "at the end of the step")
            if not keep:
                continue
            if r.shard is not None:
                if self._divisor != 1:
                    r.shard.div_(self._divisor)
                self._scatter[id(r.bucket)][1](r.shard)
                continue
            assert r.flat is not None
            flat, bucket = r.flat, r.bucket
            if bucket.buffers:
                flat.div_(dist.get_world_size(bucket.process_group(self._rank)))
                offset = 0
                for b in bucket.buffers:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
                continue
            if self._divisor != 1:
                flat.div_(self._divisor)
            offset = 0
            for p in bucket.parameters:
                n = p.numel()
                part = flat[offset : offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    p.grad = part.clone()
                else:
                    p.grad.copy_(part)

    def abandon(self) -> None:
        """Forget the step's reductions without waiting (a peer is gone)."""
        self._running = []
        self._started.clear()


@torch.no_grad()
def _flat_gradients(bucket: Bucket, layout: ShardLayout) -> tuple[Tensor, Tensor]:
    """The bucket's gradients in one padded flat tensor (the parameters' own ``.grad``
    dropped), and the tensor its shard of the sum goes to."""
    first = bucket.parameters[0]
    flat = torch.zeros(layout.padded, dtype=first.dtype, device=first.device)
    for p, offset in zip(bucket.parameters, layout.offsets, strict=True):
        if p.grad is not None:
            flat[offset : offset + p.numel()].copy_(p.grad.detach().reshape(-1))
            # Only the shard of the sum is kept (see twobp.runtime.state.sharded_optimizer).
            p.grad = None
    return flat, torch.empty(layout.size, dtype=flat.dtype, device=flat.device)


def _grad(p: nn.Parameter) -> Tensor:
    return p.grad.detach() if p.grad is not None else torch.zeros_like(p)
