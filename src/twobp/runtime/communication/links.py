"""A process group per direction of each neighbouring pair of ranks: the step's links.

A *link* carries the transfers of one direction between two neighbouring
pipeline ranks (``src -> dst``), and nothing else. On it the sender's order
is the only order: the receiver posts its receives in that order, as early as
it likes, and no receive stands in the way of a send. On NCCL the operations
of one communicator run one after the other on one stream and match by order
alone: a receive posted ahead on a communicator that the other direction
shared would hold back this rank's next send on it, and the two ranks could
wait on each other. With a communicator per direction they cannot.

Making them. Every rank of the world makes every link of every copy of the
pipeline, in one order (:func:`link_order`), with plain ``new_group``, which
every rank of the world calls for every group and which names groups by a
count that every rank keeps alike. (``use_local_synchronization`` would let
each rank make only its own links, but torch names such a group by its ranks
and the number of groups the making rank belongs to, which differs between a
rank with two neighbours and a rank with one: the two ends of a link would
look for different groups.) A rank belongs to as many links as it has
neighbours, twice; so that every rank belongs to as many groups as every other
afterwards, as the groups that other code makes with
``use_local_synchronization`` need, each rank makes one-rank groups for the
difference. Links are made once per process, rank pairs and timeout, and
shared by later pipelines (:func:`twobp.runtime.base.process_state.shared_group`).

That needs every rank of the world in the pipeline's group. A pipeline in a
smaller group (``Pipeline(group=...)``) runs its transfers on that one group
instead (:attr:`Links.split` is False), and the channel then posts a receive
ahead only up to its next send to the same peer, as a shared communicator
requires.

:func:`warm_up` then moves one small tensor over every link of this rank, in
the same order on every rank, before any step: a backend that connects
lazily (NCCL without ``device_id``, which creates a communicator on its first
operation) connects every link there, in an order all ranks agree on,
instead of on a step's first transfers, where ranks meet their links in
different orders.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from twobp.runtime.base.group import Membership
from twobp.runtime.base.process_state import even_out, is_made, shared_group
from twobp.runtime.communication.collective import complete
from twobp.runtime.errors import PipelineClosedError, PipelineError
from twobp.schedule.schedule import Schedule


def neighbour_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The pairs of pipeline ranks that hold neighbouring stages (lower rank first)."""
    graph, placement = schedule.graph, schedule.placement
    pairs = set()
    for stage in range(graph.n_stages):
        after = graph.neighbour(stage, 1)
        if after is not None and placement[after] != placement[stage]:
            a, b = placement[stage], placement[after]
            pairs.add((min(a, b), max(a, b)))
    return sorted(pairs)


def link_order(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Both directions of every pair (global ranks), in the order every rank makes them.

    Args:
        pairs: neighbouring pairs of ranks, in any order or direction, repeated or not.

    Returns:
        ``(src, dst)`` for both directions of every pair: pairs by their
        (lower, higher) ranks, the link from the lower rank first.
    """
    unique = sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})
    return [link for low, high in unique for link in ((low, high), (high, low))]


@dataclass(frozen=True)
class Links:
    """The process group of each link of this rank, held weakly (by global ranks).

    Args:
        rank: this process's global rank.
        groups: for each ``(src, dst)`` of global ranks, its group; empty when
            the transfers share the pipeline's group.
        shared: the pipeline's group, which carries every transfer when
            ``groups`` is empty.
    """

    rank: int
    groups: dict[tuple[int, int], weakref.ref[dist.ProcessGroup]]
    shared: Membership

    @property
    def split(self) -> bool:
        """True if each direction has a group of its own (receives may be posted freely)."""
        return bool(self.groups)

    def group(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group that carries ``src -> dst`` (global ranks).

        Raises:
            PipelineError: if the link was never made (a bug of the runtime).
            PipelineClosedError: if its group was destroyed since.
        """
        if not self.groups:
            group = self.shared.group
            assert group is not None, "links in a single process world"
            return group
        ref = self.groups.get((src, dst))
        if ref is None:
            raise PipelineError(
                f"rank {self.rank} has no link {src} -> {dst}; the schedule and the links "
                "made for it disagree (this is a bug of the runtime)"
            )
        group = ref()
        if group is None:
            raise PipelineClosedError(
                f"rank {self.rank}: the process group of the link {src} -> {dst} was destroyed "
                "(torch.distributed.destroy_process_group); build a new Pipeline after "
                "init_process_group"
            )
        return group


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None


def make_links(
    members: Membership,
    schedule: Schedule,
    grid: Sequence[Sequence[int]],
    timeout: float,
    device: torch.device,
) -> Links:
    """Make (or find) the links of every copy of the pipeline, then warm this rank's up.

    Collective over the world; every rank calls it at the same point of
    building a pipeline.

    Args:
        members: this process's place in the pipeline's group.
        schedule: the schedule (which stages neighbour, on which pipeline ranks).
        grid: the group ranks of every copy of the pipeline (``grid[d][r]``).
        timeout: seconds, the groups' timeout and the warm-up's.
        device: where the warm-up tensors live.

    Returns:
        The links, by global ranks.

    Raises:
        PeerTimeoutError, PeerFailedError: if a peer does not warm up a link.
    """
    me = members.global_rank(members.rank)
    if members.size != dist.get_world_size() or members.group is not _world():
        # A group of the caller's own (Pipeline(group=...)): no groups made behind it, which
        # would outlive its destroy_process_group(group).
        return Links(me, {}, members)
    pairs = [
        (members.global_rank(row[a]), members.global_rank(row[b]))
        for row in grid
        for a, b in neighbour_pairs(schedule)
    ]
    order = link_order(pairs)
    groups = {}
    made = []
    for src, dst in order:
        key, ranks = f"link {src}->{dst}", sorted((src, dst))
        if not is_made(key, ranks, timeout, every_rank=True):
            made.append((src, dst))
        group = shared_group(key, ranks, timeout, every_rank=True)
        if group is not None:
            groups[(src, dst)] = weakref.ref(group)
    even_out(made, me, timeout)
    mine = [link for link in order if me in link]
    links = Links(me, groups, members)
    warm_up(links, mine, device, timeout)
    return links


def warm_up(
    links: Links, order: list[tuple[int, int]], device: torch.device, timeout: float
) -> None:
    """One small tensor over every link of ``order``, one link at a time, in that order."""
    for src, dst in order:
        _warm_up_link(links, src, dst, device, timeout)


def _warm_up_link(links: Links, src: int, dst: int, device: torch.device, timeout: float) -> None:
    token = torch.zeros(1, device=device)
    sends = src == links.rank

    def post() -> object:
        # The group is looked up when posted: no frame of a traceback may hold it.
        group = links.group(src, dst)
        if sends:
            return dist.isend(token, dst=dst, group=group)
        return dist.irecv(token, src=src, group=group)

    complete(
        post,
        token,
        rank=links.rank,
        peer=dst if sends else src,
        where="building the pipeline",
        what=f"the warm-up of the link {src} -> {dst}",
        timeout=timeout,
    )
