import struct

from twobp.schedule.action import Action
from twobp.timeline import Span
from twobp.viz.png import default_size, render_png


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


SPANS = [
    Span(0, Action.parse("0F0"), 0, 1),
    Span(1, Action.parse("1F0"), 1, 2),
    Span(1, Action.parse("1I0"), 2, 3),
    Span(0, Action.parse("0B0"), 3, 5),
    Span(1, Action.parse("1W0"), 3, 4),
]


def test_png_has_requested_size(tmp_path):
    out = render_png(SPANS, tmp_path / "t.png", title="tiny", size=(640, 240))
    assert out.exists()
    assert png_size(out) == (640, 240)


def test_png_default_size_grows_with_ranks(tmp_path):
    out = render_png(SPANS, tmp_path / "d.png", n_ranks=4)
    assert png_size(out) == default_size(4)
    assert default_size(8)[1] > default_size(4)[1]


def test_png_of_empty_timeline(tmp_path):
    assert png_size(render_png([], tmp_path / "e.png", size=(300, 200))) == (300, 200)
