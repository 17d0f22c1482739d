import json

import pytest

from twobp.schedule.action import Action
from twobp.timeline import Span
from twobp.viz.trace import to_trace, write_trace

SPANS = [
    Span(0, Action.parse("0F0"), 10.0, 10.5),
    Span(1, Action.parse("1F0"), 10.5, 11.0),
    Span(1, Action.parse("1W0-3"), 11.0, 13.0),
    Span(0, Action.parse("0SEND_F0"), 10.5, 10.6),
]


def test_trace_file_has_one_complete_event_per_compute_span(tmp_path):
    path = write_trace(SPANS, tmp_path / "t.json", title="tiny")
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3
    by_name = {e["name"]: e for e in events}
    w = by_name["1W0-3"]
    assert w["pid"] == 1
    assert w["ts"] == pytest.approx(1.0e6)
    assert w["dur"] == pytest.approx(2.0e6)
    assert w["args"]["stage"] == 1
    assert w["args"]["microbatches"] == [0, 1, 2, 3]
    assert by_name["0F0"]["ts"] == 0.0
    assert doc["otherData"]["title"] == "tiny"


def test_trace_names_processes_by_rank():
    meta = [e for e in to_trace(SPANS)["traceEvents"] if e["ph"] == "M"]
    assert [(e["pid"], e["args"]["name"]) for e in meta] == [(0, "rank 0"), (1, "rank 1")]
