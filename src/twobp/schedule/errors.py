"""The errors of the schedule layer, and the rank-by-step grid a deadlock shows.

A deadlock error ends with the grid of what ran, one row per lock-step step
and one column per rank, and a last row with each rank's stuck action::

    step | rank 0 | rank 1
    -----+--------+-------
       0 | 0F0    | .
       1 | 0F1    | 1F0
    stuck| >0I1<  | >1I0<

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twobp.schedule.action import Action

# How many steps a deadlock grid shows.
_MAX_GRID_STEPS = 40


class ScheduleError(ValueError):
    """A schedule is malformed or cannot run to the end (it deadlocks)."""


class DeadlockError(ScheduleError, RuntimeError):
    """The schedule cannot finish: some rank waits for something that never comes."""


def format_grid(
    steps: Sequence[Sequence[Action | None]],
    ranks: Sequence[int],
    stuck: Mapping[int, Action | None] | None = None,
) -> str:
    """Render steps as an ASCII grid: rows are steps, columns are ranks.

    Args:
        steps: the lock-step grid of a walk, as :func:`twobp.schedule.validate.dry_run`
            returns it (``None`` shows as ``.``).
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
