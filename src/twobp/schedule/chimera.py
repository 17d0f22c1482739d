"""Chimera: two pipelines in opposite directions over the same ranks.

Chimera (Li and Hoefler, SC'21), as the 2BP paper runs it: the model's ``p``
stages form a "down" pipeline, stage ``s`` on rank ``s``, and an "up"
pipeline, stage ``s`` on rank ``p - 1 - s``. Every rank holds two stages of
the model, one of each pipeline, and each pipeline takes half of the
micro-batches. Where one pipeline leaves a rank idle (its warm-up and
cool-down), the other has work for it, so the bubble of a step shrinks to
about half of 1F1B's. The price: each rank holds two stages' weights, and
the two replicas of every stage reduce their gradients at the end of the
step (the ``R`` action, added by :func:`twobp.schedule.lowering.add_reductions`).

As a :class:`~twobp.schedule.schedule.Schedule` it has ``2p`` stages in two
pipelines: stages ``0..p-1`` are the down pipeline (micro-batches ``0..m/2-1``)
and stages ``p..2p-1`` the up pipeline (micro-batches ``m/2..m-1``); stage
``p + s`` runs the model's stage ``s`` on rank ``p - 1 - s``. Each pipeline
keeps the order of 1F1B over its micro-batches, and each rank merges its two
lists by earliest start (a forward takes 1, a fused backward 2; ties go to
the backward, then to the down pipeline). ``p = 2``, ``m = 4``::

    rank 0: 0F0 0F1 3F2 0B0 3B2 0B1 3F3 3B3
    rank 1: 2F2 1F0 2F3 1B0 1F1 1B1 2B2 2B3

This module imports no torch.
"""

from __future__ import annotations

from twobp.schedule.action import Action, Kind
from twobp.schedule.dependencies import Key, produces, requires
from twobp.schedule.generators import one_f_one_b
from twobp.schedule.kinds import ActionKind
from twobp.schedule.schedule import Schedule, StageGraph

_TIME: dict[ActionKind, float] = {Kind.FORWARD: 1.0, Kind.FULL_BACKWARD: 2.0}


def chimera_placement(n_ranks: int) -> tuple[int, ...]:
    """Stage ``s < p`` on rank ``s``; stage ``p + s`` on rank ``p - 1 - s``."""
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))


def chimera(n_ranks: int, n_microbatches: int) -> Schedule:
    """Chimera with two pipelines over ``p`` ranks.

    Args:
        n_ranks: number of ranks ``p``, even.
        n_microbatches: micro-batches of the step over both pipelines ``m``, even.

    Returns:
        The schedule (fused backward), named ``"chimera"``, with ``n_pipelines = 2``.

    Raises:
        ValueError: if ``p`` or ``m`` is odd.
    """
    if n_ranks % 2:
        raise ValueError(
            f"chimera needs an even number of ranks (each rank holds a stage of both "
            f"pipelines, stage s and p-1-s), got {n_ranks}"
        )
    if n_microbatches % 2:
        raise ValueError(
            f"chimera needs an even number of micro-batches (half go down, half up), "
            f"got {n_microbatches}"
        )
    p, half = n_ranks, n_microbatches // 2
    placement = chimera_placement(p)
    single = one_f_one_b(p, half)
    down = {r: list(single.actions[r]) for r in range(p)}
    # The up pipeline: 1F1B's position s is stage p + s on rank p - 1 - s.
    up = {
        p - 1 - s: [
            Action(p + a.stage, a.kind, tuple(half + m for m in a.microbatches))
            for a in single.actions[s]
        ]
        for s in range(p)
    }
    actions = _merge(placement, {r: (down[r], up[r]) for r in range(p)})
    return Schedule(placement, n_microbatches, actions, "chimera", n_pipelines=2)


def _merge(
    placement: tuple[int, ...], lists: dict[int, tuple[list[Action], list[Action]]]
) -> dict[int, tuple[Action, ...]]:
    """Interleave each rank's two lists by earliest start, in unit times.

    Each list alone runs without deadlock, and a rank only ever starts an
    action whose inputs are there, so the merge always goes on.
    """
    graph = StageGraph(placement, n_pipelines=2)
    position = {r: [0, 0] for r in lists}
    free = dict.fromkeys(lists, 0.0)
    made: dict[Key, float] = {}
    out: dict[int, list[Action]] = {r: [] for r in lists}
    left = sum(len(a) + len(b) for a, b in lists.values())
    while left:
        best: tuple[float, int, int, int] | None = None  # start, not backward, rank, which
        for rank, pair in lists.items():
            for which, listed in enumerate(pair):
                index = position[rank][which]
                if index == len(listed):
                    continue
                action = listed[index]
                needs = requires(action, graph, lowered=False)
                if any(k not in made for k in needs):
                    continue
                ready = max((made[k] for k in needs), default=0.0)
                is_forward = int(action.kind is Kind.FORWARD)
                choice = (max(free[rank], ready), is_forward, rank, which)
                if best is None or choice < best:
                    best = choice
        assert best is not None, "each pipeline alone runs to the end"
        start, _, rank, which = best
        action = lists[rank][which][position[rank][which]]
        position[rank][which] += 1
        end = start + _TIME[action.kind]
        free[rank] = end
        made.update(dict.fromkeys(produces(action), end))
        out[rank].append(action)
        left -= 1
    return {r: tuple(acts) for r, acts in out.items()}
