"""A timeline as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing).

Each compute span becomes one complete event (``"ph": "X"``) in the process
of its rank (``pid`` = rank), with ``ts`` and ``dur`` in microseconds from the
earliest start, ``name`` the action's text form (``1F0``, ``2W0-3``) and
``args`` its stage, micro-batches and kind. Metadata events name each process
``rank N``. This module imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twobp.timeline import Span, kind_label
from twobp.viz.labels import compute_spans

_US_PER_S = 1e6


def to_trace(spans: Sequence[Span], *, title: str = "") -> dict[str, Any]:
    """The trace document of ``spans`` (times in seconds).

    Args:
        spans: the timeline (communication spans are ignored).
        title: stored as ``otherData.title``.

    Returns:
        A JSON-ready dict with ``traceEvents``.
    """
    work = compute_spans(spans)
    origin = min((s.start for s in work), default=0.0)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        for r in sorted({s.rank for s in work})
    ]
    for s in work:
        events.append(
            {
                "name": str(s.action),
                "cat": s.action.kind.value,
                "ph": "X",
                "pid": s.rank,
                "tid": 0,
                "ts": (s.start - origin) * _US_PER_S,
                "dur": s.duration * _US_PER_S,
                "args": {
                    "stage": s.action.stage,
                    "microbatches": list(s.action.microbatches),
                    "kind": kind_label(s.action.kind),
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_trace(spans: Sequence[Span], path: str | Path, *, title: str = "") -> Path:
    """Write :func:`to_trace` of ``spans`` as JSON to ``path``; returns the path."""
    out = Path(path)
    out.write_text(json.dumps(to_trace(spans, title=title)) + "\n", encoding="utf-8")
    return out
