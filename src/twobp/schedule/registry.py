"""The schedules by name: :data:`SCHEDULES` and :func:`generate`.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from twobp.schedule import chimera, dualpipe, generators, zero_bubble
from twobp.schedule.schedule import Schedule


@dataclass(frozen=True)
class ScheduleInfo:
    """What a named schedule is and what it accepts.

    Args:
        name: the registry name.
        description: one line for tables and ``--help``.
        natively_split: True if it has ``I`` and ``W`` of its own (zero
            bubble); False if its backward is fused (``B``) until
            :func:`~twobp.schedule.two_bp.apply_two_bp` splits it.
        default_stages_per_rank: stages per rank when none is given.
        allowed_stages_per_rank: the values it accepts, or ``None`` for any
            ``v >= 1``.
        build: ``(p, m, v) -> Schedule``.
        pipelines: how many pipelines it runs over the same ranks (2 for Chimera).
    """

    name: str
    description: str
    natively_split: bool
    default_stages_per_rank: int
    allowed_stages_per_rank: tuple[int, ...] | None
    build: Callable[[int, int, int], Schedule]
    pipelines: int = 1


def _single(make: Callable[[int, int], Schedule]) -> Callable[[int, int, int], Schedule]:
    return lambda p, m, _v: make(p, m)


SCHEDULES: Mapping[str, ScheduleInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            ScheduleInfo(
                "naive",
                "no pipelining: each micro-batch goes forward and back through all stages alone",
                False,
                1,
                None,
                generators.naive,
            ),
            ScheduleInfo(
                "gpipe",
                "all forwards, then all backwards (GPipe; looped BFS with v > 1)",
                False,
                1,
                None,
                generators.gpipe,
            ),
            ScheduleInfo(
                "1f1b",
                "p-1-r warm-up forwards, then one forward one backward (PipeDream-flush)",
                False,
                1,
                (1,),
                _single(generators.one_f_one_b),
            ),
            ScheduleInfo(
                "interleaved-1f1b",
                "Megatron's interleaved 1F1B over v looped stages per rank; m % p == 0",
                False,
                2,
                None,
                generators.interleaved_1f1b,
            ),
            ScheduleInfo(
                "chimera",
                "Chimera: two 1F1B pipelines in opposite directions, each rank holds a stage "
                "of both; p and m even",
                False,
                1,
                (1,),
                _single(chimera.chimera),
                pipelines=2,
            ),
            ScheduleInfo(
                "zb-h1",
                "Zero Bubble H1: 1F1B memory, W delayed into the cool-down",
                True,
                1,
                (1,),
                _single(zero_bubble.zb_h1),
            ),
            ScheduleInfo(
                "zb-h2",
                "Zero Bubble H2: deeper warm-up (up to 2p-1 in flight), less bubble",
                True,
                1,
                (1,),
                _single(zero_bubble.zb_h2),
            ),
            ScheduleInfo(
                "zb-v",
                "Zero Bubble V: 2 stages per rank in a V shape, 1F1B memory",
                True,
                2,
                (2,),
                _single(zero_bubble.zb_v),
            ),
            ScheduleInfo(
                "dualpipev",
                "DualPipeV (DeepSeek): DualPipe's order on the V of zb-v, zero bubble in warm-up "
                "and cool-down; m >= 2p",
                True,
                2,
                (2,),
                _single(dualpipe.dualpipev),
            ),
            ScheduleInfo(
                "dualpipe",
                "DualPipe (DeepSeek-V3): two pipelines in opposite directions, each rank runs "
                "DualPipeV's order over a stage of both; p and m even, m >= 2p",
                True,
                1,
                (1,),
                _single(dualpipe.dualpipe),
                pipelines=2,
            ),
        )
    }
)
"""Every schedule :func:`generate` knows, by name (read-only)."""


def generate(
    name: str, n_ranks: int, n_microbatches: int, *, stages_per_rank: int | None = None
) -> Schedule:
    """Build the named schedule.

    Args:
        name: one of :data:`SCHEDULES`.
        n_ranks: number of ranks ``p >= 1``.
        n_microbatches: number of micro-batches ``m >= 1``.
        stages_per_rank: stages per rank ``v``; ``None`` takes the schedule's
            default (2 for ``interleaved-1f1b``, ``zb-v`` and ``dualpipev``, else 1).

    Returns:
        The schedule; its backward is fused (``B``) unless the schedule is
        natively split (see :attr:`ScheduleInfo.natively_split`).

    Raises:
        ValueError: on an unknown name (the message lists the valid ones), a
            count below 1, or a combination the schedule does not support.
    """
    info = SCHEDULES.get(name)
    if info is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    if n_ranks < 1 or n_microbatches < 1:
        raise ValueError(
            f"{name}: need n_ranks >= 1 and n_microbatches >= 1, got {n_ranks} and {n_microbatches}"
        )
    v = info.default_stages_per_rank if stages_per_rank is None else stages_per_rank
    allowed = info.allowed_stages_per_rank
    if v < 1 or (allowed is not None and v not in allowed):
        flexible = [n for n, i in SCHEDULES.items() if i.allowed_stages_per_rank is None]
        accepted = "any v >= 1" if allowed is None else " or ".join(map(str, allowed))
        raise ValueError(
            f"{name} takes stages_per_rank {accepted}, got {v}; schedules that take any "
            f"stages_per_rank: {', '.join(flexible)}; zb-v and dualpipev take 2"
        )
    return info.build(n_ranks, n_microbatches, v)
