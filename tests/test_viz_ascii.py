import pytest

from twobp.schedule.action import Action
from twobp.timeline import Span
from twobp.viz.ascii import render_ascii


def spans_of(rows):
    """Spans from {rank: [(text, start, end), ...]}."""
    return [Span(r, Action.parse(t), a, b) for r, row in rows.items() for t, a, b in row]


GPIPE_2X2 = spans_of(
    {
        0: [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)],
        1: [("1F0", 1, 2), ("1F1", 2, 3), ("1B0", 3, 5), ("1B1", 5, 7)],
    }
)


def test_gpipe_grid_exactly():
    assert render_ascii(GPIPE_2X2, title="gpipe") == (
        "gpipe: makespan 9, bubble ratio 33.3% (1 column = 1)\n"
        "rank 0 | F0 F1 .  .  .  B0~~~ B1~~~\n"
        "rank 1 | .  F0 F1 B0~~~ B1~~~ .  ."
    )


def test_split_backward_and_concatenated_weight():
    spans = spans_of(
        {
            0: [("0F0", 0, 1), ("0F1", 1, 2), ("0I0", 4, 5), ("0I1", 5, 6), ("0W0-1", 6, 8)],
            1: [("1F0", 1, 2), ("1F1", 2, 3), ("1I0", 3, 4), ("1I1", 4, 5), ("1W0-1", 5, 7)],
        }
    )
    assert render_ascii(spans) == (
        "makespan 8, bubble ratio 25.0% (1 column = 1)\n"
        "rank 0 | F0 F1 .  .  I0 I1 W0-1~\n"
        "rank 1 | .  F0 F1 I0 I1 W0-1~ ."
    )


def test_stage_shown_when_a_rank_holds_several():
    spans = spans_of({0: [("0F0", 0, 1), ("1F0", 1, 2), ("1B0", 2, 4), ("0B0", 4, 6)]})
    assert render_ascii(spans).splitlines()[1] == "rank 0 | 0F0 1F0 1B0~~~~ 0B0~~~~"


def test_label_cut_when_field_too_narrow():
    # W over four micro-batches in the time of one: its field is one cell.
    spans = spans_of({0: [("0F0", 0, 1), ("0W0-3", 1, 2)]})
    assert render_ascii(spans).splitlines()[1] == "rank 0 | F0 W+"


def test_scales_time_to_fit_width():
    spans = spans_of({0: [(f"0F{k}", k, k + 1) for k in range(100)]})
    text = render_ascii(spans, width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    # Labels up to F99 take 4 characters: 18 columns fit, so 6 actions each.
    assert "(1 column = 6, some actions hidden)" in text
    assert text.splitlines()[1].startswith("rank 0 | F0  F6  F12 ")


def test_idle_rank_rows_and_empty_timeline():
    assert render_ascii([], n_ranks=2) == "makespan 0, bubble ratio 0.0%\nrank 0 |\nrank 1 |"
    text = render_ascii(GPIPE_2X2, n_ranks=3)
    assert text.splitlines()[3] == "rank 2 | .  .  .  .  .  .  .  .  ."


def test_communication_spans_are_not_drawn():
    spans = [*GPIPE_2X2, Span(0, Action.parse("0SEND_F0"), 1, 1.5)]
    assert render_ascii(spans, title="gpipe") == render_ascii(GPIPE_2X2, title="gpipe")


def test_too_narrow():
    with pytest.raises(ValueError, match="too narrow"):
        render_ascii(GPIPE_2X2, width=5)


def test_a_background_reduction_counts_in_the_makespan_but_hides_nothing():
    # Rank 0's all-reduce of stage 0 runs from 3 to 8, under its F1 and B1.
    spans = spans_of(
        {
            0: [("0F0", 0, 1), ("0B0", 1, 3), ("0R0-1", 3, 8), ("0F1", 3, 4), ("0B1", 4, 6)],
        }
    )
    assert render_ascii(spans) == (
        "makespan 8, bubble ratio 25.0% (1 column = 1)\nrank 0 | F0 B0~~~ F1 B1~~~ .  ."
    )
