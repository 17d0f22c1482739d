"""Renderers of timelines: terminal grid, PNG picture, Chrome/Perfetto trace.

They read :class:`twobp.timeline.Span` (start and end times), so simulated
and measured timelines are drawn the same way.
"""

from twobp.viz.ascii import render_ascii
from twobp.viz.png import render_png
from twobp.viz.trace import to_trace, write_trace

__all__ = ["render_ascii", "render_png", "to_trace", "write_trace"]
