"""Checking a schedule: coverage, order on each rank, and a deadlock dry-run.

:func:`validate` runs three checks and raises :class:`ScheduleError` at the
first that fails:

1. coverage: every (stage, micro-batch) has exactly one ``F`` and either one
   ``B`` or one ``I`` plus exactly one ``W`` covering it; a lowered schedule
   has exactly one send and one receive for every transfer between ranks, and
   none elsewhere;
2. order on a rank: an action never comes before one of the same rank that it
   needs (``F`` before ``I`` before ``W``, a send after what it sends...);
3. dry-run: all ranks advance step by step, each running its next action when
   everything it needs was done in an earlier step (sends do not block); this
   is the walk of :mod:`twobp.schedule.walk` with one step per action. If a
   step makes no progress the schedule deadlocks; the error shows the
   rank-by-step grid with the stuck action of each rank marked::

       step | rank 0 | rank 1
       -----+--------+-------
          0 | 0F0    | .
          1 | 0F1    | 1F0
       stuck| >0I1<  | >1I0<

The dependency rules are those of :mod:`twobp.schedule.dependencies`, read
from the kind table; coverage knows the kinds of a training step (F, B, I,
W and the transfers); other declared kinds are checked by order and dry-run.
This module imports no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from twobp.schedule.action import Action, Kind
from twobp.schedule.dependencies import describe, index_producers, is_lowered, requires
from twobp.schedule.errors import DeadlockError, ScheduleError, format_grid
from twobp.schedule.kinds import KINDS, ActionKind, kind_spec
from twobp.schedule.schedule import Schedule
from twobp.schedule.walk import Grid, walk

__all__ = ["DeadlockError", "ScheduleError", "dry_run", "format_grid", "validate"]

# How many problems one error lists.
_MAX_PROBLEMS = 12


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` is complete, well ordered and deadlock-free.

    Args:
        schedule: the schedule to check.

    Raises:
        ScheduleError: naming the rank, the action and what is missing or
            misplaced; a deadlock error includes the rank-by-step grid.
    """
    _check_coverage(schedule)
    _check_rank_order(schedule)
    dry_run(schedule)


def dry_run(schedule: Schedule) -> Grid:
    """Run the schedule in lock-step and return the rank-by-step grid.

    Each step, every rank whose next action has everything it needs (made in
    an earlier step) runs it; the others wait (``None`` in the grid). This is
    :func:`~twobp.schedule.walk.walk` with one step per action.

    Args:
        schedule: the schedule; its coverage is not checked here.

    Returns:
        The steps, one tuple per step with one cell per rank.

    Raises:
        DeadlockError: a :class:`ScheduleError`, if a step makes no progress,
            with the grid and, for each stuck rank, what it waits for.
        ScheduleError: if two actions make the same result.
    """
    return walk(schedule, _one_step, lowered=is_lowered(schedule)).grid()


def _one_step(_action: Action) -> float:
    return 1.0


def _check_coverage(schedule: Schedule) -> None:
    seen: dict[tuple[int, ActionKind, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            for m in a.microbatches:
                seen[(a.stage, a.kind, m)].append((rank, i))

    problems: list[str] = []

    def count(stage: int, kind: Kind, m: int) -> int:
        return len(seen.get((stage, kind, m), ()))

    def where(stage: int, kind: Kind, m: int) -> str:
        return ", ".join(f"rank {r} #{i}" for r, i in seen[(stage, kind, m)])

    placement, n_stages = schedule.placement, schedule.n_stages
    for s in range(n_stages):
        rank = placement[s]
        for m in schedule.microbatches_of(s):
            f, b = count(s, Kind.FORWARD, m), count(s, Kind.FULL_BACKWARD, m)
            i = count(s, Kind.BACKWARD_INPUT, m) + count(s, Kind.BACKWARD_INPUT_REBUILT, m)
            w = count(s, Kind.BACKWARD_WEIGHT, m) + count(s, Kind.BACKWARD_WEIGHT_REBUILD, m)
            rebuilt = count(s, Kind.BACKWARD_INPUT_REBUILT, m)
            if i == 1 and w == 1 and rebuilt != count(s, Kind.BACKWARD_WEIGHT_REBUILD, m):
                problems.append(
                    f"stage {s} micro-batch {m}: {'an IR' if rebuilt else 'a WR'} needs "
                    f"{'a WR' if rebuilt else 'an IR'} (its stash is dropped by {s}IR{m} and "
                    f"rebuilt by a WR covering it): make both plain I and W, or both IR and WR"
                )
            if f != 1:
                problems.append(
                    f"stage {s} micro-batch {m}: expected one {s}F{m} on rank {rank}, found {f}"
                    + (f" ({where(s, Kind.FORWARD, m)})" if f else "")
                )
            if b and (i or w):
                problems.append(
                    f"stage {s} micro-batch {m} has both {s}B{m} and a split backward (I/W) "
                    f"on rank {rank}: keep one of them"
                )
            elif b > 1:
                problems.append(
                    f"{s}B{m} appears {b} times ({where(s, Kind.FULL_BACKWARD, m)}): keep one"
                )
            elif not b and (i != 1 or w != 1):
                if not i and not w:
                    problems.append(
                        f"stage {s} micro-batch {m} has no backward: add {s}B{m}, "
                        f"or {s}I{m} and a W covering it, to rank {rank}"
                    )
                else:
                    problems.append(
                        f"stage {s} micro-batch {m} on rank {rank}: expected one {s}I{m} and one "
                        f"W covering micro-batch {m}, found {i} I and {w} W"
                    )
    problems.extend(_reduction_problems(schedule, seen))
    if is_lowered(schedule):
        problems.extend(_communication_problems(schedule, seen))
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        raise ScheduleError(
            f"{schedule.name or 'schedule'} is incomplete or has repeats:\n  "
            + "\n  ".join(problems[:_MAX_PROBLEMS])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _reduction_problems(
    schedule: Schedule, seen: Mapping[tuple[int, ActionKind, int], list[tuple[int, int]]]
) -> list[str]:
    """A stage's gradient reduction, where listed, covers its micro-batches once."""
    problems: list[str] = []
    reduce = Kind.REDUCE
    for s in range(schedule.n_stages):
        own = schedule.microbatches_of(s)
        counts = [len(seen.get((s, reduce, m), ())) for m in own]
        if not any(counts):
            continue
        if set(counts) != {1}:
            problems.append(
                f"stage {s}: its gradient reduction must be one {s}R{own.start}-{own.stop - 1} "
                f"covering every micro-batch of its pipeline ({own.start}..{own.stop - 1}); "
                f"found {sum(counts)} R entries"
            )
    return problems


def _communication_problems(
    schedule: Schedule, seen: Mapping[tuple[int, ActionKind, int], list[tuple[int, int]]]
) -> list[str]:
    placement, n_stages = schedule.placement, schedule.n_stages

    def crosses(a: int, b: int) -> bool:
        return schedule.neighbour(a, b - a) is not None and placement[a] != placement[b]

    problems: list[str] = []
    for (stage, kind, m), spots in seen.items():
        link = kind_spec(kind).link
        if link is None:
            continue
        if not crosses(stage, stage + link):
            problems.append(
                f"{stage}{kind.value}{m} on rank {spots[0][0]} is not a transfer between two "
                f"ranks (stage {stage + link} is not its neighbour or is on the same rank): "
                "remove it"
            )
        elif len(spots) > 1:
            problems.append(f"{stage}{kind.value}{m} appears {len(spots)} times: keep one")
    # Each boundary between two ranks needs every transfer kind once per
    # micro-batch, on the stage whose link points across it.
    transfers = [(Kind(code), spec.link) for code, spec in KINDS.items() if spec.link is not None]
    for s in range(n_stages - 1):
        if not crosses(s, s + 1):
            continue
        for m in schedule.microbatches_of(s):
            for kind, link in transfers:
                stage = s if link > 0 else s + 1
                if (stage, kind, m) not in seen:
                    problems.append(
                        f"rank {placement[stage]} lacks {stage}{kind.value}{m}: stages {s} and "
                        f"{s + 1} are on different ranks (run add_communication to insert "
                        "transfers)"
                    )
    return problems


def _check_rank_order(schedule: Schedule) -> None:
    lowered = is_lowered(schedule)
    producer = index_producers(schedule, lowered)
    for rank, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            for k in requires(a, schedule.graph, lowered):
                made_by = producer.get(k)
                if made_by is not None and made_by[0] == rank and made_by[1] > i:
                    j = made_by[1]
                    raise ScheduleError(
                        f"rank {rank} lists {a} (its action #{i}) before {acts[j]} "
                        f"(#{j}), which it needs ({describe(k)}): move {a} after {acts[j]}"
                    )
