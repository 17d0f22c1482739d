"""Point-to-point transfers of one step, each receive posted as soon as it can be.

A :class:`StepChannel` moves this rank's remote transfers over the step's
links (:mod:`twobp.runtime.communication.links`): a process group per
direction of each neighbouring pair, on which the sender's order (its part of
the pair order of :mod:`twobp.schedule.transfers`) is the only order. Sends
are posted right after the compute that produced them. Receives are posted in
the sender's order, each as early as it can be: at the start of the step,
into buffers allocated from the boundary's known layout; a gradient once the
activation it answers has gone out (its sender cannot send it before). So a
receive is posted before its sender can send it, and its data moves while
this rank computes, whatever else the pair exchanges in the other direction.
A layout holds for the micro-batches of one number of rows under one signature
of the step's inputs (:mod:`twobp.runtime.communication.layout_cache`); where it
is not known yet (the first step of a signature), the sender puts a small
layout message before the first activation of that many rows, and the
receiver posts the data receives once it has read it. All sends are completed
in :meth:`StepChannel.finish`.

Tags are unique per (direction, boundary, micro-batch, tensor) within a step,
which gloo honours; NCCL ignores tags and relies on the order of each link,
which both sides follow. A channel made with ``order_only=True`` (the pipeline
option ``order_only_matching``, or :data:`ORDER_ONLY_VARIABLE` set to ``1`` when
the pipeline is built) sends every operation with tag 0, so that gloo too
matches by order only, as NCCL does: the test suite runs distributed cases in
that mode (``tests/test_runtime_order_only.py``), so that nothing comes to rely
on tags.

Lifetimes: a send's tensor is held (with its handle) until
:meth:`StepChannel.finish` or :meth:`StepChannel.drain` has waited for it, so
it outlives the send on any stream; a receive's buffers are handed to the
compute only after its handle was waited for. Every wait takes the pipeline's
timeout, and torch's NCCL backend blocks the host in a wait with a timeout
until the transfer is done (without one it would only order the current
stream after it): so a receive waits on the host, on every backend, and a
stuck peer raises :class:`twobp.runtime.errors.PeerTimeoutError` instead of
hanging (see docs/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from twobp.runtime.base.topology import Topology
from twobp.runtime.communication.collective import wait_work
from twobp.runtime.communication.layout_cache import BoundaryLayouts
from twobp.runtime.communication.links import Links
from twobp.runtime.communication.tensor_layout import (
    MESSAGE_LENGTH,
    BoundaryMeta,
    TensorMeta,
    describe_mismatch,
    failure_message,
    is_failure_message,
)
from twobp.runtime.errors import PeerStepFailedError, PipelineError, ShapeMismatchError
from twobp.schedule.action import Action
from twobp.schedule.transfers import CommPlan, Direction, PairOp, Transfer

MAX_TENSORS = 64
"""Most tensors one block may pass to the next (tags reserve room for this many)."""

ORDER_ONLY_VARIABLE = "TWOBP_ORDER_ONLY_MATCHING"
"""Environment variable: ``1`` sends every point-to-point operation with tag 0
(matching by order only, as on NCCL), as the pipeline option ``order_only_matching``
does. Read once, when a pipeline is built (:func:`order_only_matching`)."""

_TAG_CODE = {Direction.ACTIVATION: 0, Direction.GRADIENT: 1}
_META_CODE = 2


def order_only_matching(requested: bool = False) -> bool:
    """Whether a pipeline's channels send every tag 0: if ``requested`` (its option
    ``order_only_matching``), or if :data:`ORDER_ONLY_VARIABLE` asks for it now."""
    return requested or os.environ.get(ORDER_ONLY_VARIABLE, "") == "1"


@dataclass
class _Posted:
    works: list[Any]
    buffers: list[Tensor]
    layout: tuple[TensorMeta, ...]
    is_tuple: bool
    src: int
    marks: _Marks | None = None


class _Marks:
    """Tells without waiting whether a receive's data is in its buffers, on gloo, where a
    receive completes only inside a wait (``is_completed`` stays False until one).

    Before the receive is posted, the last bytes of each buffer are set to a pattern; gloo
    writes a message into its buffer in order, so once every buffer's last bytes differ
    from the pattern the data is there (a message that ends in the pattern itself reads
    as not there yet: the caller then waits as it would have anyway).
    """

    def __init__(self, buffers: Sequence[Tensor], pattern: Tensor) -> None:
        self._tails = []
        for buffer in buffers:
            raw = buffer.detach().reshape(-1).view(torch.uint8)
            if raw.numel():
                tail = raw[-min(raw.numel(), pattern.numel()) :]
                tail.copy_(pattern[: tail.numel()])
                self._tails.append(tail)
        self._pattern = pattern

    def arrived(self) -> bool:
        return all(not torch.equal(t, self._pattern[: t.numel()]) for t in self._tails)


@dataclass
class _Peer:
    """What this rank exchanges with one peer, and how far it got."""

    rank: int
    ops: tuple[PairOp, ...]
    outgoing: tuple[Transfer, ...]
    """This rank's sends to the peer, in order (the link to it)."""
    incoming: tuple[Transfer, ...]
    """The peer's sends to this rank, in its order (the link from it)."""
    sends_before: tuple[int, ...]
    """For each receive, how many sends come before it in the pair order."""
    receives_before: tuple[int, ...]
    """For each send, how many receives come before it in the pair order."""
    sent: int = 0
    """Sends posted (or completed as placeholders)."""
    received: int = 0
    """Receives posted."""
    sends: list[tuple[Any, Tensor, Transfer]] = field(default_factory=list)

    @classmethod
    def of(cls, rank: int, ops: tuple[PairOp, ...]) -> _Peer:
        """The peer ``rank`` with its pair order ``ops``."""
        outgoing = tuple(op.transfer for op in ops if op.is_send)
        incoming = tuple(op.transfer for op in ops if not op.is_send)
        sends_before, receives_before, sends, receives = [], [], 0, 0
        for op in ops:
            if op.is_send:
                receives_before.append(receives)
                sends += 1
            else:
                sends_before.append(sends)
                receives += 1
        return cls(rank, ops, outgoing, incoming, tuple(sends_before), tuple(receives_before))

    @property
    def done(self) -> bool:
        """True when every send and receive of the step is posted."""
        return self.sent == len(self.outgoing) and self.received == len(self.incoming)


_NOTHING = BoundaryMeta((), False)
"""What a failure message in place of a layout stands for: no tensors follow."""


class StepChannel:
    """The remote transfers of one rank for one step.

    Args:
        plan: this pipeline rank's pair orders (peers are pipeline ranks).
        topology: where the pipeline ranks run (never a single process world).
        links: the process group of each direction to every peer.
        device: where receive buffers live.
        layouts: activation layouts learnt so far for the step's input
            signature; filled in where unknown.
        timeout: seconds to wait on a peer before raising.
        n_stages: stages of the schedule (to make tags unique).
        n_microbatches: micro-batches per step (to make tags unique).
        rows: the rows of each micro-batch (None: all alike). Micro-batches of
            as many rows share a layout.
        order_only: send every operation with tag 0 (matching by order only, as
            NCCL does).
        watch_receives: mark each receive's buffers as it is posted, so that
            :meth:`arrived` can tell on gloo (the ``dynamic`` 2BP policy; see
            :class:`_Marks`); False: only the receive's own ``is_completed`` answers.
    """

    def __init__(
        self,
        plan: CommPlan,
        topology: Topology,
        links: Links,
        device: torch.device,
        layouts: BoundaryLayouts,
        timeout: float,
        n_stages: int,
        n_microbatches: int,
        rows: Sequence[int] | None = None,
        order_only: bool = False,
        watch_receives: bool = False,
    ) -> None:
        self._pattern = (
            torch.randint(
                1, 256, (8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
            )
            if watch_receives
            else None
        )
        self._plan = plan
        self._topology = topology
        self._members = topology.members
        self._links = links
        self._device = device
        self._layouts = layouts
        self._timeout = timeout
        self._n_stages = n_stages
        self._n_mb = n_microbatches
        self._rows = tuple(rows) if rows is not None else (0,) * n_microbatches
        self._order_only = order_only
        self._split = links.split
        self._peers = {p: _Peer.of(p, ops) for p, ops in plan.peers.items()}
        self._posted: dict[tuple[Direction, int, int], _Posted] = {}
        self._meta_works: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._sent_nothing: set[tuple[Direction, int, int]] = set()
        self._sent_activations: set[tuple[Direction, int, int]] = set()
        self.action: Action | None = None
        """The action being run, named in errors."""
        self.layout_messages = 0
        """Layout messages this rank sent or read in the step (none when every layout
        was known)."""

    # -- public ---------------------------------------------------------------

    def post_ahead(self) -> None:
        """Post every receive that can be posted now without waiting."""
        for peer in self._peers.values():
            self._advance(peer, block=False, until=None)

    def send(self, transfer: Transfer, tensors: Sequence[Tensor], is_tuple: bool) -> None:
        """Post the sends of ``transfer`` (the next of this rank's sends to its peer).

        Raises:
            ShapeMismatchError: if the tensors differ from the boundary's layout.
            PipelineError: if ``transfer`` is not the next send to the peer (a bug).
        """
        peer = self._peers[transfer.dst]
        if peer.sent >= len(peer.outgoing) or peer.outgoing[peer.sent] != transfer:
            self._out_of_order(peer, transfer)
        if not self._split:
            # One group carries both directions: the receives before this send in
            # the pair order are posted first (on NCCL they share a stream).
            while peer.received < peer.receives_before[peer.sent]:
                if not self._post_recv(peer.incoming[peer.received], block=True):
                    self._out_of_order(peer, transfer)
                peer.received += 1
        layout = self._check_layout(transfer, tensors, is_tuple)
        for index, tensor in enumerate(tensors):
            self._post_send(transfer, tensor.detach().contiguous(), self._tag(transfer, index))
        assert len(tensors) == len(layout)
        self._sent(peer, transfer)
        # A gradient that answers this activation can be received from now on.
        self._advance(peer, block=False, until=None)

    def recv(self, transfer: Transfer) -> tuple[tuple[Tensor, ...], bool]:
        """Wait for the tensors of ``transfer``.

        Returns:
            The tensors (activations flagged ``requires_grad`` as sent) and
            whether the block produced a tuple.

        Raises:
            PeerTimeoutError: if the peer does not deliver within the timeout.
            PeerFailedError: if the connection to the peer fails.
        """
        peer = self._peers[transfer.src]
        if transfer.key not in self._posted and transfer.key not in self._sent_nothing:
            self._advance(peer, block=True, until=transfer)
        if transfer.key in self._sent_nothing:
            self._sent_nothing.discard(transfer.key)
            where = f"at {self.action}" if self.action is not None else "in the step"
            raise PeerStepFailedError(
                f"rank {self._members.rank} {where}: rank "
                f"{self._topology.group_rank(transfer.src)} failed in this step and sent no "
                f"{transfer}",
                self._members.rank,
                self._topology.group_rank(transfer.src),
            )
        posted = self._posted.pop(transfer.key)
        for work in posted.works:
            self._wait(work, transfer.src, str(transfer))
        for buf, meta in zip(posted.buffers, posted.layout, strict=True):
            buf.requires_grad_(meta.requires_grad and transfer.direction is Direction.ACTIVATION)
        self._advance(peer, block=False, until=None)
        return tuple(posted.buffers), posted.is_tuple

    def arrived(self, transfer: Transfer) -> bool:
        """Whether :meth:`recv` of ``transfer`` would return without waiting: its data is
        here (or its sender failed, which ``recv`` then says). Never blocks."""
        key = transfer.key
        if key not in self._posted and key not in self._sent_nothing:
            self._advance(self._peers[transfer.src], block=False, until=None)
        if key in self._sent_nothing:
            return True
        posted = self._posted.get(key)
        if posted is None:
            return False
        if posted.marks is not None and not posted.marks.arrived():
            return False
        return posted.marks is not None or all(w.is_completed() for w in posted.works)

    def finish(self) -> None:
        """Complete every send of the step.

        Raises:
            PeerError: if a send does not complete.
        """
        self.action = None
        for peer in self._peers.values():
            for work, _, transfer in peer.sends:
                self._wait(work, peer.rank, f"the send of the {transfer}")
            peer.sends.clear()
        leftover = [
            str(t)
            for p in self._peers.values()
            for t in (*p.outgoing[p.sent :], *p.incoming[p.received :])
        ]
        if leftover or self._posted:
            raise PipelineError(
                f"rank {self._members.rank} ended the step with transfers not done: "
                f"{leftover or list(self._posted)}; the schedule and the communication plan "
                "disagree (this is a bug of the runtime)"
            )

    def drain(self) -> None:
        """After this rank failed part-way through the step: complete the step's pair orders.

        Every send this rank still owes goes out as zeros of the boundary's
        layout (or, where it never learnt the layout, as a failure message in
        place of the layout), and every receive it still expects is posted and
        completed. Its peers, which run the step on, are never left waiting on
        it, and no transfer of the step is left to meet one of a later step.
        They learn that the step failed from the status every rank reports at
        the step's end. The owed sends and receives are walked in each pair's
        order, so that a placeholder goes out only once the layout messages
        before it were read.

        Raises:
            PeerError: if a peer is gone or times out meanwhile.
        """
        self.action = None
        block = False
        while True:
            moved = False
            unfinished = []
            for peer in self._peers.values():
                before = (peer.sent, peer.received)
                self._drain_peer(peer, block)
                moved |= (peer.sent, peer.received) != before
                if not peer.done:
                    unfinished.append(peer)
            if not unfinished:
                break
            # Blocking on a layout message only when nothing else can move.
            block = not moved
        for key in list(self._posted):
            posted = self._posted.pop(key)
            for work in posted.works:
                self._wait(work, posted.src, "a transfer of the failed step")
        self._sent_nothing.clear()
        self.finish()

    def _drain_peer(self, peer: _Peer, block: bool) -> None:
        sends = receives = 0
        for op in peer.ops:
            if op.is_send:
                sends += 1
                if sends > peer.sent:
                    self._send_placeholder(op.transfer)
                    self._sent(peer, op.transfer)
                continue
            receives += 1
            if receives > peer.received:
                if not self._post_recv(op.transfer, block):
                    return
                peer.received += 1

    def _send_placeholder(self, transfer: Transfer) -> None:
        known = self._layouts.get(self._key(transfer))
        if transfer.direction is Direction.GRADIENT:
            if known is None:
                return  # neither side learnt the layout: nothing crosses
            layout = known.gradient
        elif known is None:
            message = failure_message().to(self._device)
            self._post_send(transfer, message, self._meta_tag(transfer))
            return
        else:
            layout = known.tensors
        for index, meta in enumerate(layout):
            payload = torch.zeros(meta.shape, dtype=meta.dtype, device=self._device)
            self._post_send(transfer, payload, self._tag(transfer, index))

    def abandon(self) -> None:
        """Give up the step's transfers after a failure: drop every posted operation.

        Gloo cannot cancel a posted receive; dropped, it stays unmatched on
        the connection and keeps no buffer of this rank. Nothing of the step is
        kept after this.
        """
        self._posted.clear()
        self._meta_works.clear()
        for peer in self._peers.values():
            peer.sends.clear()
        self.action = None

    # -- the order of each link -----------------------------------------------------

    def _sent(self, peer: _Peer, transfer: Transfer) -> None:
        peer.sent += 1
        if transfer.direction is Direction.ACTIVATION:
            self._sent_activations.add(transfer.key)

    def _advance(self, peer: _Peer, block: bool, until: Transfer | None) -> None:
        """Post the peer's next receives in its order; stop where one cannot be posted yet.

        With ``block``, wait for layout messages instead of stopping at them,
        and stop once ``until`` is posted. Where one group carries both
        directions (:attr:`Links.split` is False), a receive also waits for
        the sends before it in the pair order.
        """
        while peer.received < len(peer.incoming):
            transfer = peer.incoming[peer.received]
            held_back = not self._split and peer.sent < peer.sends_before[peer.received]
            if held_back or not self._post_recv(transfer, block):
                if until is None:
                    return
                break
            peer.received += 1
            if until is not None and transfer == until:
                return
        if until is not None:
            other = self._topology.group_rank(peer.rank)
            raise PipelineError(
                f"rank {self._members.rank} at {self.action}: the {until} is not next in the "
                f"order agreed with rank {other}; the schedule and the communication plan "
                "disagree (this is a bug of the runtime)"
            )

    def _out_of_order(self, peer: _Peer, transfer: Transfer) -> None:
        other = self._topology.group_rank(peer.rank)
        raise PipelineError(
            f"rank {self._members.rank} at {self.action}: the {transfer} is not this rank's "
            f"next send to rank {other}; the schedule and the communication plan disagree "
            "(this is a bug of the runtime)"
        )

    def _post_recv(self, transfer: Transfer, block: bool) -> bool:
        """Post the receives of ``transfer``; False if it cannot be posted yet.

        A gradient waits until the activation it answers has gone out: before,
        its layout may not be known, and its sender cannot send it anyway. An
        activation waits for its boundary's layout message on the first step
        (with ``block``, this waits for the message). A transfer whose sender
        failed before it knew the layout carries nothing: it is recorded as
        such, and :meth:`recv` says so.
        """
        if transfer.direction is Direction.GRADIENT:
            if (Direction.ACTIVATION, transfer.boundary, transfer.microbatch) not in (
                self._sent_activations
            ):
                return False
            meta = self._layouts.get(self._key(transfer))
            if meta is None:
                # Only after a failure: the activations never crossed, so neither does this.
                self._sent_nothing.add(transfer.key)
                return True
            layout, is_tuple = meta.gradient, False
        else:
            known = self._activation_layout(transfer, block)
            if known is None:
                return False
            if known is _NOTHING:
                self._sent_nothing.add(transfer.key)
                return True
            layout, is_tuple = known.tensors, known.is_tuple
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self._device) for m in layout]
        # Marked before the receives are posted: the data may come at once.
        marks = _Marks(buffers, self._pattern) if self._pattern is not None else None
        works = [
            dist.irecv(
                buf,
                src=self._global(transfer.src),
                group=self._link(transfer),
                tag=self._tag(transfer, i),
            )
            for i, buf in enumerate(buffers)
        ]
        posted = _Posted(works, buffers, layout, is_tuple, transfer.src, marks)
        self._posted[transfer.key] = posted
        return True

    def _activation_layout(self, transfer: Transfer, block: bool) -> BoundaryMeta | None:
        key = self._key(transfer)
        if key in self._layouts:
            return self._layouts[key]
        if key not in self._meta_works:
            message = torch.empty(MESSAGE_LENGTH, dtype=torch.int64, device=self._device)
            work = dist.irecv(
                message,
                src=self._global(transfer.src),
                group=self._link(transfer),
                tag=self._meta_tag(transfer),
            )
            self._meta_works[key] = (work, message)
        work, message = self._meta_works[key]
        if not block and not work.is_completed():
            return None
        self._wait(work, transfer.src, f"the layout of the {transfer}")
        del self._meta_works[key]
        self.layout_messages += 1
        if is_failure_message(message.cpu()):
            return _NOTHING
        self._layouts[key] = BoundaryMeta.decode(message.cpu())
        return self._layouts[key]

    # -- layouts and tags -------------------------------------------------------

    def _check_layout(
        self, transfer: Transfer, tensors: Sequence[Tensor], is_tuple: bool
    ) -> tuple[TensorMeta, ...]:
        if len(tensors) > MAX_TENSORS:
            raise PipelineError(
                f"stage {transfer.boundary} passes {len(tensors)} tensors to the next stage; "
                f"at most {MAX_TENSORS} are supported"
            )
        key = self._key(transfer)
        if transfer.direction is Direction.GRADIENT:
            expected = self._layouts[key].gradient
            got = tuple(TensorMeta(tuple(t.shape), t.dtype, True) for t in tensors)
        else:
            meta = BoundaryMeta.of(tensors, is_tuple)
            if key not in self._layouts:
                self._send_layout(transfer, meta)
            expected, got = self._layouts[key].tensors, meta.tensors
        problem = describe_mismatch(expected, got)
        if problem is not None:
            raise ShapeMismatchError(
                f"rank {transfer.src} -> rank {transfer.dst}, boundary stage {transfer.boundary}"
                f" -> stage {transfer.boundary + 1}, {transfer.direction.value} of micro-batch "
                f"{transfer.microbatch}: {problem}. Inputs of these shapes passed the layout "
                f"[{', '.join(map(str, expected))}] there before (in this step or an earlier "
                "one); the shapes a block passes on may follow the shapes of its inputs, not "
                "their values (pad or cut such an output to a size fixed by the input's shape)"
            )
        return expected

    def _send_layout(self, transfer: Transfer, meta: BoundaryMeta) -> None:
        self._post_send(transfer, meta.encode().to(self._device), self._meta_tag(transfer))
        self._layouts[self._key(transfer)] = meta
        self.layout_messages += 1

    def _post_send(self, transfer: Transfer, payload: Tensor, tag: int) -> None:
        """Post one send of ``transfer``'s; :meth:`finish` completes it."""
        work = dist.isend(
            payload, dst=self._global(transfer.dst), group=self._link(transfer), tag=tag
        )
        self._peers[transfer.dst].sends.append((work, payload, transfer))

    def _tag(self, transfer: Transfer, index: int) -> int:
        if self._order_only:
            return 0
        code = _TAG_CODE[transfer.direction]
        slot = (code * self._n_stages + transfer.boundary) * self._n_mb + transfer.microbatch
        return slot * MAX_TENSORS + index

    def _key(self, transfer: Transfer) -> tuple[int, int]:
        """Where the layout of ``transfer`` is kept: its boundary and its micro-batch's rows."""
        return transfer.boundary, self._rows[transfer.microbatch]

    def _meta_tag(self, transfer: Transfer) -> int:
        if self._order_only:
            return 0
        # A step's micro-batches have at most two sizes (the larger first): one tag each.
        size_class = int(self._rows[transfer.microbatch] != self._rows[0])
        base = (_META_CODE * self._n_stages + transfer.boundary) * self._n_mb * MAX_TENSORS
        return base + size_class

    def _link(self, transfer: Transfer) -> dist.ProcessGroup:
        """The group of the direction ``transfer`` goes (looked up when posted)."""
        return self._links.group(self._global(transfer.src), self._global(transfer.dst))

    def _global(self, pipeline_rank: int) -> int:
        """The default-group rank of a pipeline rank (what point-to-point calls take)."""
        return self._members.global_rank(self._topology.group_rank(pipeline_rank))

    # -- waiting ------------------------------------------------------------------

    def _wait(self, work: Any, peer: int, what: str) -> None:
        where = f"at {self.action}" if self.action is not None else "at the end of the step"
        wait_work(
            work,
            rank=self._members.rank,
            peer=self._topology.group_rank(peer),
            where=where,
            what=what,
            timeout=self._timeout,
        )
