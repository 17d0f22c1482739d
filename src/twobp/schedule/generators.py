"""Classic schedules with a fused backward: naive, GPipe, 1F1B, interleaved 1F1B.

Each generator is a pure function of the number of ranks ``p``, of
micro-batches ``m`` and of stages per rank ``v``, and returns a
:class:`~twobp.schedule.schedule.Schedule` whose backward is fused (``B``).
:func:`~twobp.schedule.two_bp.apply_two_bp` splits it into ``I`` and ``W``.

With ``v > 1`` the placement is *looped*: stage ``s`` lives on rank ``s % p``.
Pictures below are for ``p = 2``, ``m = 2`` (one row per rank, in order)::

    naive   rank 0: 0F0 0B0 0F1 0B1          one micro-batch at a time
            rank 1: 1F0 1B0 1F1 1B1
    gpipe   rank 0: 0F0 0F1 0B0 0B1          all forwards, then all backwards
            rank 1: 1F0 1F1 1B0 1B1
    1f1b    rank 0: 0F0 0F1 0B0 0B1          p-1-r warm-up forwards, then F,B pairs
            rank 1: 1F0 1B0 1F1 1B1

This module imports no torch.
"""

from __future__ import annotations

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule

F, B = Kind.FORWARD, Kind.FULL_BACKWARD


def looped_placement(n_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % n_ranks``, for ``n_ranks * stages_per_rank`` stages."""
    return tuple(s % n_ranks for s in range(n_ranks * stages_per_rank))


def naive(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """Model parallelism without pipelining, as the 2BP paper's "naive" baseline.

    One micro-batch goes forward through every stage and back before the
    next one starts, so ranks never overlap (the paper uses one micro-batch:
    the whole batch). With ``m > 1`` micro-batches run one after another,
    which is gradient accumulation: still no overlap between ranks.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m``.
        stages_per_rank: stages per rank ``v`` (looped placement).

    Returns:
        The schedule, named ``"naive"``.
    """
    placement = looped_placement(n_ranks, stages_per_rank)
    actions: dict[int, list[Action]] = {}
    for rank in range(n_ranks):
        local = [s for s, r in enumerate(placement) if r == rank]
        acts: list[Action] = []
        for m in range(n_microbatches):
            acts += [Action(s, F, (m,)) for s in local]
            acts += [Action(s, B, (m,)) for s in reversed(local)]
        actions[rank] = acts
    return Schedule(placement, n_microbatches, _freeze(actions), "naive")


def gpipe(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """GPipe: every forward of every micro-batch, then every backward.

    With ``v > 1`` each rank runs its stages breadth-first (all micro-batches
    of its first stage, then of its next one), the "looped BFS" order.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m``.
        stages_per_rank: stages per rank ``v`` (looped placement).

    Returns:
        The schedule, named ``"gpipe"``.
    """
    placement = looped_placement(n_ranks, stages_per_rank)
    mbs = range(n_microbatches)
    actions: dict[int, list[Action]] = {}
    for rank in range(n_ranks):
        local = [s for s, r in enumerate(placement) if r == rank]
        acts = [Action(s, F, (m,)) for s in local for m in mbs]
        acts += [Action(s, B, (m,)) for s in reversed(local) for m in mbs]
        actions[rank] = acts
    return Schedule(placement, n_microbatches, _freeze(actions), "gpipe")


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, then one forward, one backward.

    Rank ``r`` runs ``min(p - 1 - r, m)`` warm-up forwards, then pairs
    ``F(k + warm-up), B(k)`` while forwards remain, then the remaining
    backwards. At most ``p - r`` micro-batches are in flight on rank ``r``.
    Any ``m >= 1`` works; the 2BP paper's 1F1B-1 and 1F1B-2 are ``m = p``
    and ``m = 2p``; with ``m < p`` the warm-up is cut short, like GPipe.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m``.

    Returns:
        The schedule, named ``"1f1b"``.
    """
    actions: dict[int, list[Action]] = {}
    m_total = n_microbatches
    for rank in range(n_ranks):
        warmup = min(n_ranks - 1 - rank, m_total)
        acts = [Action(rank, F, (m,)) for m in range(warmup)]
        for k in range(m_total - warmup):
            acts += [Action(rank, F, (warmup + k,)), Action(rank, B, (k,))]
        acts += [Action(rank, B, (k,)) for k in range(m_total - warmup, m_total)]
        actions[rank] = acts
    return Schedule(tuple(range(n_ranks)), n_microbatches, _freeze(actions), "1f1b")


def interleaved_1f1b(n_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B over ``v`` looped stages per rank.

    Work goes in rounds of ``p`` micro-batches: a rank runs the forwards of
    one round on its first stage, then on its second one, and so on
    (depth-first), and the backwards in the opposite stage order. Rank ``r``
    warms up with ``(v - 1) * p + 2 * (p - 1 - r)`` forwards (capped at
    ``m * v``), then alternates one forward and one backward, then drains the
    backwards. This is the order of ``torch.distributed.pipelining``'s
    ``ScheduleInterleaved1F1B`` when ``m`` is a multiple of ``p`` (without
    Megatron's special case of an all-forward warm-up when ``m == p``).
    With ``v = 1`` it is 1F1B with that deeper warm-up.

    Args:
        n_ranks: number of ranks ``p``.
        n_microbatches: number of micro-batches ``m``; must be a multiple of ``p``.
        stages_per_rank: stages per rank ``v``.

    Returns:
        The schedule, named ``"interleaved-1f1b"``.

    Raises:
        ValueError: if ``m`` is not a multiple of ``p``.
    """
    p, m, v = n_ranks, n_microbatches, stages_per_rank
    if m % p:
        raise ValueError(
            f"interleaved-1f1b needs the number of micro-batches to be a multiple of the "
            f"number of ranks: got m={m}, p={p}; use m in {{{p}, {2 * p}, {3 * p}, ...}}"
        )
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    actions: dict[int, list[Action]] = {}
    for rank in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)

        def forward(k: int, rank: int = rank) -> Action:
            return Action(((k // p) % v) * p + rank, F, (microbatch(k),))

        def backward(k: int, rank: int = rank) -> Action:
            return Action((v - 1 - (k // p) % v) * p + rank, B, (microbatch(k),))

        acts = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [forward(warmup + k), backward(k)]
        acts += [backward(k) for k in range(total - warmup, total)]
        actions[rank] = acts
    return Schedule(looped_placement(p, v), m, _freeze(actions), "interleaved-1f1b")


def _freeze(actions: dict[int, list[Action]]) -> dict[int, tuple[Action, ...]]:
    return {r: tuple(a) for r, a in actions.items()}
