"""CSV files in torch.distributed.pipelining's layout: round trips and torch's own files."""

import pytest

from twobp.schedule import (
    Schedule,
    add_communication,
    apply_two_bp,
    from_rows,
    generate,
    load_csv,
    save_csv,
    to_rows,
)

# What torch's ScheduleZBVZeroBubble(p=2, m=2)._dump_csv writes (checked against
# torch in test_schedule_torch_reference): idle steps are empty cells, stages
# 0 and 3 are on rank 0, stages 1 and 2 on rank 1.
TORCH_ZBV_P2_M2 = (
    "0F0,0F1,,3F0,3I0,3W0,3F1,3I1,3W1,0I0,0W0,,,,0I1,0W1,,\n"
    ",1F0,2F0,1F1,2F1,2I0,2W0,,1I0,1W0,,2I1,2W1,1I1,,,1W1,,\n"
)


def same(a: Schedule, b: Schedule) -> bool:
    return (a.placement, a.n_microbatches, a.actions) == (b.placement, b.n_microbatches, b.actions)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize(
    "schedule",
    [
        generate("1f1b", 3, 5),
        apply_two_bp(generate("1f1b", 3, 5), "paper"),
        generate("zb-v", 3, 4),
        generate("interleaved-1f1b", 2, 4, stages_per_rank=3),
        add_communication(apply_two_bp(generate("gpipe", 2, 3), "fill")),
    ],
    ids=lambda s: s.name,
)
def test_round_trip(tmp_path, schedule, aligned):
    path = tmp_path / "s.csv"
    save_csv(schedule, path, aligned=aligned)
    back = load_csv(path)
    assert same(back, schedule)
    assert back.name == "s"


def test_file_looks_like_torch(tmp_path):
    path = tmp_path / "1f1b.csv"
    save_csv(apply_two_bp(generate("1f1b", 2, 2), "paper"), path)
    assert path.read_bytes().decode() == "0F0,0F1,0I0,0W0,0I1,0W1\r\n1F0,1I0,1F1,1I1,1W0-1\r\n"


def test_aligned_file_leaves_waiting_steps_empty(tmp_path):
    path = tmp_path / "gpipe.csv"
    save_csv(generate("gpipe", 2, 2), path, aligned=True)
    assert path.read_text().splitlines() == ["0F0,0F1,,,0B0,0B1", ",1F0,1F1,1B0,1B1"]


def test_reads_torch_zbv_with_v_placement(tmp_path):
    path = tmp_path / "zbv.csv"
    path.write_text(TORCH_ZBV_P2_M2)
    s = load_csv(path)
    assert s.placement == (0, 1, 1, 0)
    assert s.n_microbatches == 2
    assert same(s, generate("zb-v", 2, 2))


def test_placement_can_be_given():
    s = from_rows([["0F0", "0B0"], ["1F0", "1B0"]], placement=(0, 1))
    assert s.placement == (0, 1)
    with pytest.raises(ValueError, match="not on rank 0"):
        from_rows([["0F0", "0B0"], ["1F0", "1B0"]], placement=(1, 0))


def test_bad_files_are_explained():
    with pytest.raises(ValueError, match="rank 1, cell 2: cannot parse action '1UNSHARD'"):
        from_rows([["0F0"], ["1F0", "", "1UNSHARD"]], name="x")
    with pytest.raises(ValueError, match="stage 0 is listed by rank 0 and rank 1"):
        from_rows([["0F0"], ["0B0"]])
    with pytest.raises(ValueError, match=r"stages \[1\] appear in no row"):
        from_rows([["0F0", "2F0"], ["3F0"]])
    with pytest.raises(ValueError, match="rank 0 lists no action"):
        from_rows([[], ["1F0"]])
    with pytest.raises(ValueError, match="no action in any row"):
        from_rows([[""], []])


def test_to_rows_is_the_text_form():
    s = generate("zb-h1", 2, 2)
    assert to_rows(s) == [
        ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"],
    ]
    assert same(from_rows(to_rows(s)), s)
