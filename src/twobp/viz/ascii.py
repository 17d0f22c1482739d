"""A timeline as a text grid for the terminal.

One row per rank, time cut into equal columns; each cell shows the action
that fills most of the column (kind and micro-batch, ``F0``, ``I3``,
``W0-3``) or ``.`` when the rank is idle for most of it. An action that
fills several columns is one field, its label padded with ``~``::

    gpipe: makespan 9, bubble ratio 33.3% (1 column = 1)
    rank 0 | F0 F1 .  .  .  B0~~~ B1~~~
    rank 1 | .  F0 F1 B0~~~ B1~~~ .  .

The column length is the shortest action, made a whole number of times
longer when the grid would not fit the width; the header then says that
some actions are hidden. The stage is written too (``1F0``) when a rank
holds several stages. This module imports no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from twobp.timeline import Span, bubble_ratio, makespan
from twobp.viz.labels import action_label, compute_spans, drawn_spans, several_stages_per_rank

IDLE = "."
CONTINUED = "~"


def render_ascii(
    spans: Sequence[Span],
    *,
    title: str = "",
    width: int = 120,
    n_ranks: int | None = None,
) -> str:
    """Draw ``spans`` as a rank-by-time text grid.

    Args:
        spans: the timeline, simulated or measured (communication spans are
            ignored; gradient reductions count in the makespan but are not
            drawn: they run in the background).
        title: a label for the header line (e.g. the schedule name).
        width: the most characters a line may have; time is scaled to fit.
        n_ranks: draw this many rows even if some ranks ran nothing
            (default: up to the highest rank seen).

    Returns:
        The header line and one line per rank, joined by newlines, without
        trailing spaces.

    Raises:
        ValueError: if ``width`` leaves no room for a single column.
    """
    timed = compute_spans(spans)
    # Background reductions count in the makespan but are not drawn.
    work = drawn_spans(timed)
    rows = n_ranks if n_ranks is not None else max((s.rank for s in timed), default=-1) + 1
    total = makespan(timed)
    ratio = bubble_ratio(timed) if timed else 0.0
    header = f"{title + ': ' if title else ''}makespan {total:.4g}, bubble ratio {ratio:.1%}"
    if not work or total <= 0:
        return "\n".join([header] + [f"rank {r} |" for r in range(rows)])

    with_stage = several_stages_per_rank(work)
    labels = {id(s): action_label(s.action, with_stage) for s in work}
    # Cells are as wide as the labels of single micro-batch actions; a
    # concatenated W (``W0-7``) usually spans several columns and gets a
    # field as wide as those columns together.
    single = [labels[id(s)] for s in work if len(s.action.microbatches) == 1]
    cell = max([3, *(len(t) + 1 for t in single)])
    prefix = f"rank {rows - 1} | "
    max_columns = (width - len(prefix) + 1) // cell
    if max_columns < 1:
        raise ValueError(
            f"width {width} is too narrow for a timeline; use at least {len(prefix) + cell}"
        )
    shortest = min((s.duration for s in work if s.duration > 0), default=total)
    # A whole number of shortest actions per column keeps column edges on
    # action edges when costs are round numbers.
    column = shortest * math.ceil(total / shortest / max_columns - 1e-9)
    n_columns = math.ceil(total / column - 1e-9)
    origin = min(s.start for s in timed)

    hidden = ", some actions hidden" if column > shortest * 1.001 else ""
    lines = [f"{header} (1 column = {column:.4g}{hidden})"]
    for rank in range(rows):
        owners = _column_owners([s for s in work if s.rank == rank], origin, column, n_columns)
        fields = []
        for owner, run in itertools.groupby(owners, key=lambda s: None if s is None else id(s)):
            n = len(list(run))
            if owner is None:
                fields += [IDLE.ljust(cell - 1)] * n
            else:
                fields.append(_field(labels[owner], cell - 1, n))
        name = f"rank {rank} | ".rjust(len(prefix))
        lines.append((name + " ".join(fields)).rstrip())
    return "\n".join(lines)


def _column_owners(
    spans: Sequence[Span], origin: float, column: float, n_columns: int
) -> list[Span | None]:
    """For each column, the span that fills most of it, or None if the rank
    is idle for most of it."""
    owners: list[Span | None] = []
    for c in range(n_columns):
        lo, hi = origin + c * column, origin + (c + 1) * column
        overlaps = [(min(hi, s.end) - max(lo, s.start), s) for s in spans]
        overlaps = [(o, s) for o, s in overlaps if o > 0]
        if sum(o for o, _ in overlaps) < column / 2:
            owners.append(None)
        else:
            owners.append(max(overlaps, key=lambda x: x[0])[1])
    return owners


def _field(label: str, cell: int, n_columns: int) -> str:
    """The text of an action filling ``n_columns`` columns of ``cell``
    characters: its label, padded with ``~`` over the columns it continues
    into, or cut and ended with ``+`` if it does not fit."""
    width = n_columns * (cell + 1) - 1
    if len(label) > width:
        return label[: width - 1] + "+"
    return label.ljust(width, " " if n_columns == 1 else CONTINUED)
