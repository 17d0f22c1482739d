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
   everything it needs was done in an earlier step (sends do not block). If a
   step makes no progress the schedule deadlocks; the error shows the
   rank-by-step grid with the stuck action of each rank marked::

       step | rank 0 | rank 1
       -----+--------+-------
          0 | 0F0    | .
          1 | 0F1    | 1F0
       stuck| >0I1<  | >1I0<

The dependency rules are those of :mod:`twobp.schedule.dependencies`.
This module imports no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from twobp.schedule.action import Action, Kind
from twobp.schedule.dependencies import (
    COMMUNICATION,
    Key,
    describe,
    describe_wait,
    is_lowered,
    produces,
    requires,
)
from twobp.schedule.schedule import Schedule

# How many problems one error lists, and how many steps a deadlock grid shows.
_MAX_PROBLEMS = 12
_MAX_GRID_STEPS = 40


class ScheduleError(ValueError):
    """A schedule is malformed or cannot run to the end (it deadlocks)."""


Steps = list[tuple[Action | None, ...]]
"""One row per step, one cell per rank: the action run then, or None."""


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


def dry_run(schedule: Schedule) -> Steps:
    """Run the schedule in lock-step and return the rank-by-step grid.

    Each step, every rank whose next action has everything it needs (made in
    an earlier step) runs it; the others wait (``None`` in the grid).

    Args:
        schedule: the schedule; its coverage is not checked here.

    Returns:
        The steps, one tuple per step with one cell per rank.

    Raises:
        ScheduleError: if a step makes no progress (a deadlock), with the grid
            and, for each stuck rank, what it waits for.
    """
    lowered = is_lowered(schedule)
    ranks = sorted(schedule.actions)
    lists = schedule.actions
    position = dict.fromkeys(ranks, 0)
    done: set[Key] = set()
    steps: Steps = []
    while any(position[r] < len(lists[r]) for r in ranks):
        row: list[Action | None] = []
        made: list[Key] = []
        for r in ranks:
            nxt = lists[r][position[r]] if position[r] < len(lists[r]) else None
            if nxt is not None and all(
                k in done for k in requires(nxt, schedule.placement, lowered)
            ):
                row.append(nxt)
                made.extend(produces(nxt))
                position[r] += 1
            else:
                row.append(None)
        if not any(cell is not None for cell in row):
            raise ScheduleError(_deadlock_message(schedule, steps, position, done, lowered))
        done.update(made)
        steps.append(tuple(row))
    return steps


def format_grid(
    steps: Sequence[Sequence[Action | None]],
    ranks: Sequence[int],
    stuck: Mapping[int, Action | None] | None = None,
) -> str:
    """Render steps as an ASCII grid: rows are steps, columns are ranks.

    Args:
        steps: the grid of :func:`dry_run` (``None`` shows as ``.``).
        ranks: the rank of each column.
        stuck: for a deadlock, the action each rank is stuck at (``None`` for
            a rank that has finished); it becomes a last row marked ``>..<``.

    Returns:
        The grid as text.
    """
    shown = list(steps)
    skipped = 0
    if len(shown) > _MAX_GRID_STEPS:
        skipped = len(shown) - _MAX_GRID_STEPS
        shown = shown[skipped:]
    body: list[tuple[str, list[str]]] = [
        (str(skipped + i), ["." if a is None else str(a) for a in row])
        for i, row in enumerate(shown)
    ]
    if stuck is not None:
        body.append(
            ("stuck", [">" + str(stuck[r]) + "<" if stuck.get(r) else "(done)" for r in ranks])
        )
    header = [f"rank {r}" for r in ranks]
    widths = [
        max([len(header[c])] + [len(cells[c]) for _, cells in body]) for c in range(len(ranks))
    ]
    label_w = max([4] + [len(label) for label, _ in body])

    def line(label: str, cells: Sequence[str]) -> str:
        return f"{label:>{label_w}} | " + " | ".join(
            f"{c:<{w}}" for c, w in zip(cells, widths, strict=True)
        )

    out = [
        line("step", header),
        "-" * (label_w + 1) + "+" + "+".join("-" * (w + 2) for w in widths),
    ]
    if skipped:
        out.append(f"{'...':>{label_w}} | ({skipped} earlier steps not shown)")
    out.extend(line(label, cells) for label, cells in body)
    return "\n".join(line_.rstrip() for line_ in out)


def _deadlock_message(
    schedule: Schedule,
    steps: Steps,
    position: Mapping[int, int],
    done: set[Key],
    lowered: bool,
) -> str:
    where: dict[Key, tuple[int, int]] = {}
    for rank, acts in schedule.actions.items():
        for i, a in enumerate(acts):
            for k in produces(a):
                where.setdefault(k, (rank, i))
    ranks = sorted(schedule.actions)
    stuck: dict[int, Action | None] = {}
    reasons: list[str] = []
    for r in ranks:
        acts = schedule.actions[r]
        if position[r] >= len(acts):
            stuck[r] = None
            continue
        a = acts[position[r]]
        stuck[r] = a
        missing = [k for k in requires(a, schedule.placement, lowered) if k not in done]
        waits = [describe_wait(k, where) for k in missing]
        reasons.append(
            f"  rank {r} is stuck at {a} (its action #{position[r]}): waits for " + "; ".join(waits)
        )
    name = schedule.name or "schedule"
    return (
        f"{name} deadlocks at step {len(steps)}: no rank can run its next action.\n"
        + "\n".join(reasons)
        + "\nReorder the actions so that each one comes after what it waits for.\n"
        + format_grid(steps, ranks, stuck)
    )


def _check_coverage(schedule: Schedule) -> None:
    seen: dict[tuple[int, Kind, int], list[tuple[int, int]]] = defaultdict(list)
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
        for m in range(schedule.n_microbatches):
            f, b = count(s, Kind.FORWARD, m), count(s, Kind.FULL_BACKWARD, m)
            i, w = count(s, Kind.BACKWARD_INPUT, m), count(s, Kind.BACKWARD_WEIGHT, m)
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
    if is_lowered(schedule):
        problems.extend(_communication_problems(schedule, seen))
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        raise ScheduleError(
            f"{schedule.name or 'schedule'} is incomplete or has repeats:\n  "
            + "\n  ".join(problems[:_MAX_PROBLEMS])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _communication_problems(
    schedule: Schedule, seen: Mapping[tuple[int, Kind, int], list[tuple[int, int]]]
) -> list[str]:
    placement, n_stages = schedule.placement, schedule.n_stages

    def crosses(a: int, b: int) -> bool:
        return 0 <= a < n_stages and 0 <= b < n_stages and placement[a] != placement[b]

    # The stage boundary each kind of transfer action belongs to (its stage, its peer).
    peer = {Kind.SEND_F: 1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: 1}
    problems: list[str] = []
    for (stage, kind, m), spots in seen.items():
        if kind not in COMMUNICATION:
            continue
        if not crosses(stage, stage + peer[kind]):
            problems.append(
                f"{stage}{kind.value}{m} on rank {spots[0][0]} is not a transfer between two "
                f"ranks (stage {stage + peer[kind]} does not exist or is on the same rank): "
                "remove it"
            )
        elif len(spots) > 1:
            problems.append(f"{stage}{kind.value}{m} appears {len(spots)} times: keep one")
    for s in range(n_stages - 1):
        if not crosses(s, s + 1):
            continue
        for m in range(schedule.n_microbatches):
            for text, key, rank in (
                (f"{s}SEND_F{m}", (s, Kind.SEND_F, m), placement[s]),
                (f"{s + 1}RECV_F{m}", (s + 1, Kind.RECV_F, m), placement[s + 1]),
                (f"{s + 1}SEND_B{m}", (s + 1, Kind.SEND_B, m), placement[s + 1]),
                (f"{s}RECV_B{m}", (s, Kind.RECV_B, m), placement[s]),
            ):
                if key not in seen:
                    problems.append(
                        f"rank {rank} lacks {text}: stages {s} and {s + 1} are on different "
                        "ranks (run add_communication to insert transfers)"
                    )
    return problems


def _check_rank_order(schedule: Schedule) -> None:
    lowered = is_lowered(schedule)
    for rank, acts in schedule.actions.items():
        made_at: dict[Key, int] = {}
        for i, a in enumerate(acts):
            for k in produces(a):
                made_at.setdefault(k, i)
        for i, a in enumerate(acts):
            for k in requires(a, schedule.placement, lowered):
                j = made_at.get(k)
                if j is not None and j > i:
                    raise ScheduleError(
                        f"rank {rank} lists {a} (its action #{i}) before {acts[j]} "
                        f"(#{j}), which it needs ({describe(k)}): move {a} after {acts[j]}"
                    )
