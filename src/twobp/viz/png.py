"""A timeline as a PNG picture (matplotlib, Agg backend).

One row per rank (rank 0 on top), one box per action coloured by kind, the
micro-batch number(s) inside the box when it is wide enough, the bubble ratio
in the title and a legend of the kinds drawn. matplotlib is imported inside
:func:`render_png`, so importing this module costs nothing; the figure is
drawn without ``pyplot`` and so leaves no global state behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twobp.schedule.action import format_microbatches
from twobp.schedule.kinds import KINDS, ActionKind, Kind, kind_spec
from twobp.timeline import Span, bubble_ratio, kind_label, makespan
from twobp.viz.labels import compute_spans, drawn_spans, several_stages_per_rank

# For a kind whose table entry names no colour.
_NEUTRAL_COLOUR = "#BBBBBB"

_HATCHES = ("", "//", "..", "xx")

# Keeps labels readable on hatched boxes.
_TEXT_BACKGROUND = {"facecolor": "white", "alpha": 0.8, "pad": 1.0, "edgecolor": "none"}

# Roughly the width in pixels of one character of the box labels.
_CHAR_PX = 7.0


def kind_colour(kind: ActionKind) -> str:
    """The colour of ``kind``'s boxes: its table entry's, or a neutral grey."""
    return kind_spec(kind).colour or _NEUTRAL_COLOUR


def legend_kinds(spans: Sequence[Span]) -> list[ActionKind]:
    """The kinds of ``spans``, as the legend lists them: the built-in kinds in table
    order, then declared ones (:func:`twobp.schedule.declare_kind`) as they first appear."""
    drawn = {s.action.kind for s in spans}
    kinds: list[ActionKind] = [Kind(code) for code in KINDS if Kind(code) in drawn]
    return kinds + list(dict.fromkeys(s.action.kind for s in spans if s.action.kind not in kinds))


def default_size(n_ranks: int) -> tuple[int, int]:
    """The picture size in pixels used when none is given: 1200 wide, 60 per rank."""
    return 1200, 140 + 60 * max(n_ranks, 1)


def render_png(
    spans: Sequence[Span],
    path: str | Path,
    *,
    title: str = "",
    size: tuple[int, int] | None = None,
    dpi: int = 100,
    n_ranks: int | None = None,
    time_unit: str = "s",
    waits: Sequence[Span] = (),
) -> Path:
    """Draw ``spans`` and write the picture to ``path``.

    Args:
        spans: the timeline, simulated or measured (communication is ignored).
        path: where to write the PNG.
        title: a label for the title (e.g. the schedule name).
        size: ``(width, height)`` in pixels; default :func:`default_size`.
        dpi: dots per inch of the file (the pixel size does not change).
        n_ranks: rows to draw (default: up to the highest rank seen).
        time_unit: the unit written on the time axis.
        waits: where ranks waited on peers (``Pipeline.timeline(waits=True)``
            less the compute spans): receives and the wait for the gradient
            reductions (``R``), drawn as thin bars under each rank's row, with
            the start of every ``R`` marked. Empty: neither is drawn.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    timed = compute_spans(spans)
    # Background reductions count in the makespan but are not drawn.
    work = drawn_spans(timed)
    rows = n_ranks if n_ranks is not None else max((s.rank for s in timed), default=0) + 1
    width_px, height_px = size if size is not None else default_size(rows)
    figure = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    total = makespan(timed)
    origin = min((s.start for s in timed), default=0.0)
    with_stage = several_stages_per_rank(work)
    # Pixels per time unit of the plotting area (about 85% of the width).
    px_per_time = 0.85 * width_px / total if total > 0 else 0.0
    # With several stages per rank, the later stages of a rank are hatched
    # so that its chunks can be told apart.
    stages_of: dict[int, list[int]] = {}
    for s in work:
        stages_of.setdefault(s.rank, [])
        if s.action.stage not in stages_of[s.rank]:
            stages_of[s.rank].append(s.action.stage)
    for s in work:
        chunk = sorted(stages_of[s.rank]).index(s.action.stage)
        axes.barh(
            s.rank,
            s.duration,
            left=s.start - origin,
            height=0.8,
            color=kind_colour(s.action.kind),
            edgecolor="black",
            linewidth=0.5,
            hatch=_HATCHES[chunk % len(_HATCHES)],
        )
        # The colour tells the kind; the stage is only ambiguous when a rank
        # holds several, and then the full text form (``2W0-1``) is drawn.
        text = str(s.action) if with_stage else format_microbatches(s.action.microbatches)
        if s.duration * px_per_time >= _CHAR_PX * (len(text) + 1):
            axes.text(
                s.start - origin + s.duration / 2,
                s.rank,
                text,
                ha="center",
                va="center",
                fontsize=8,
                clip_on=True,
                bbox=_TEXT_BACKGROUND if chunk else None,
            )

    axes.set_yticks(range(rows))
    axes.set_yticklabels([f"rank {r}" for r in range(rows)])
    axes.set_ylim(rows - 0.5, -0.5)
    axes.set_xlim(0, total if total > 0 else 1)
    axes.set_xlabel(f"time ({time_unit})")
    ratio = bubble_ratio(timed) if timed else 0.0
    axes.set_title(
        f"{title + ': ' if title else ''}bubble ratio {ratio:.1%}, makespan {total:.4g} {time_unit}"
    )
    kinds = legend_kinds(work)
    legend_px = 0
    handles = [
        Patch(facecolor=kind_colour(k), edgecolor="black", label=kind_label(k)) for k in kinds
    ]
    if waits:
        handles += _draw_waits(axes, waits, [s for s in timed if s not in work], origin)
    if handles:
        figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
        legend_px = 36
    figure.tight_layout(rect=(0.0, min(legend_px / height_px, 0.5), 1.0, 1.0))
    out = Path(path)
    figure.savefig(out, dpi=dpi, format="png")
    return out


_WAIT_COLOUR = "#888888"


def _draw_waits(
    axes: Any, waits: Sequence[Span], reductions: Sequence[Span], origin: float
) -> list[Any]:
    """Draw the waits on peers under each row and mark where each ``R`` starts; returns
    the legend entries of what was drawn."""
    from matplotlib.patches import Patch

    reduce_colour = kind_colour(Kind.REDUCE)
    for s in waits:
        waiting_for_r = s.action.kind is Kind.REDUCE
        axes.barh(
            s.rank + 0.32,
            s.duration,
            left=s.start - origin,
            height=0.16,
            color=reduce_colour if waiting_for_r else _WAIT_COLOUR,
            edgecolor="none",
        )
    for s in reductions:
        axes.plot([s.start - origin] * 2, [s.rank + 0.2, s.rank + 0.4], color="black", lw=1)
        axes.text(s.start - origin, s.rank + 0.2, "R", fontsize=6, ha="center", va="bottom")
    handles = [Patch(facecolor=_WAIT_COLOUR, label="waiting on a peer (receive)")]
    if any(s.action.kind is Kind.REDUCE for s in waits):
        handles.append(Patch(facecolor=reduce_colour, label="waiting for R (all-reduce)"))
    return handles
