"""Schedules as CSV files, in the layout of ``torch.distributed.pipelining``.

One row per rank (row ``r`` is rank ``r``), one action per cell in execution
order, an empty cell for nothing (torch writes its idle steps that way)::

    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1

No header: the placement (stage ``s`` lives on the rank whose row lists it),
the number of micro-batches (one more than the largest index) and of
pipelines (the micro-batches over those stage 0 runs: 2 for Chimera) follow
from the actions. This reads torch's compute-only CSVs, with looped or
V-shaped placements alike (a cell of torch's overlapped forward and backward,
``(0F1;3B0)OVERLAP_F_B`` in DualPipeV's, is its two actions in that order),
and writes files torch reads back, as long as the schedule has no
concatenated ``W`` (``0W0-3`` is this project's extension).
This module imports no torch.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path

from twobp.schedule.action import Action
from twobp.schedule.schedule import Schedule
from twobp.schedule.validate import dry_run


def to_rows(schedule: Schedule, *, aligned: bool = False) -> list[list[str]]:
    """The cells of every rank, rank 0 first.

    Args:
        schedule: the schedule.
        aligned: if True, put each action in the column of its step in the
            lock-step dry-run (empty cells where a rank waits), which lines
            up the ranks when the file is viewed as a table.

    Returns:
        One list of cell texts per rank.
    """
    ranks = sorted(schedule.actions)
    if not aligned:
        return [[str(a) for a in schedule.actions[r]] for r in ranks]
    steps = dry_run(schedule)
    rows = [["" if row[c] is None else str(row[c]) for row in steps] for c in range(len(ranks))]
    for row in rows:
        while row and not row[-1]:
            row.pop()
    return rows


def from_rows(
    rows: Sequence[Sequence[str]], placement: Sequence[int] | None = None, name: str = ""
) -> Schedule:
    """Build a schedule from cell texts, one row per rank.

    Args:
        rows: row ``r`` holds the actions of rank ``r``; empty cells are skipped.
        placement: the rank of each stage, or ``None`` to infer it (stage
            ``s`` on the rank that lists it).
        name: the schedule's name.

    Returns:
        The schedule, with ``n_microbatches`` one more than the largest index.

    Raises:
        ValueError: on a cell that is not an action (naming row and column), a
            stage listed by two ranks, missing stages, or an empty rank.
    """
    actions: dict[int, tuple[Action, ...]] = {}
    for rank, row in enumerate(rows):
        parsed: list[Action] = []
        for column, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                parsed.extend(_cell_actions(cell))
            except ValueError as err:
                raise ValueError(
                    f"{name or 'schedule'}: rank {rank}, cell {column}: {err}"
                ) from err
        actions[rank] = tuple(parsed)
    while actions and not actions[len(actions) - 1]:
        del actions[len(actions) - 1]
    if not actions:
        raise ValueError(f"{name or 'schedule'}: no action in any row")
    if placement is None:
        placement = _infer_placement(actions, name)
    n_microbatches = 1 + max(m for acts in actions.values() for a in acts for m in a.microbatches)
    first = {m for acts in actions.values() for a in acts if a.stage == 0 for m in a.microbatches}
    pipelines = n_microbatches // len(first) if first and not n_microbatches % len(first) else 1
    if len(placement) % pipelines:
        pipelines = 1
    return Schedule(tuple(placement), n_microbatches, actions, name, pipelines)


_OVERLAPPED = re.compile(r"^\s*\((.*)\)OVERLAP_F_B\s*$")


def _cell_actions(cell: str) -> list[Action]:
    """The actions of one cell: one, or those of torch's ``(a;b)OVERLAP_F_B``, in order."""
    overlapped = _OVERLAPPED.match(cell)
    if overlapped is None:
        return [Action.parse(cell)]
    return [Action.parse(part) for part in overlapped.group(1).split(";")]


def save_csv(schedule: Schedule, path: str | Path, *, aligned: bool = False) -> None:
    """Write ``schedule`` as CSV, one row per rank (see :func:`to_rows`).

    Args:
        schedule: the schedule.
        path: the file to write.
        aligned: put each action in the column of its lock-step dry-run step.
    """
    with Path(path).open("w", newline="") as f:
        csv.writer(f).writerows(to_rows(schedule, aligned=aligned))


def load_csv(path: str | Path, placement: Sequence[int] | None = None) -> Schedule:
    """Read a schedule written by :func:`save_csv` or by torch's ``_dump_csv``.

    Args:
        path: the CSV file.
        placement: the rank of each stage, or ``None`` to infer it.

    Returns:
        The schedule, named after the file (without its suffix).

    Raises:
        ValueError: if the file does not describe a schedule (see :func:`from_rows`).
    """
    path = Path(path)
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    return from_rows(rows, placement, path.stem)


def _infer_placement(actions: dict[int, tuple[Action, ...]], name: str) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, acts in actions.items():
        if not acts:
            raise ValueError(f"{name or 'schedule'}: rank {rank} lists no action")
        for a in acts:
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"{name or 'schedule'}: stage {a.stage} is listed by rank {owner[a.stage]} "
                    f"and rank {rank} ({a}); a stage lives on one rank"
                )
    n_stages = max(owner) + 1
    missing = [s for s in range(n_stages) if s not in owner]
    if missing:
        raise ValueError(
            f"{name or 'schedule'}: stages {missing} appear in no row; stages must be "
            f"numbered 0..{n_stages - 1}"
        )
    return tuple(owner[s] for s in range(n_stages))
