"""Our generators against torch.distributed.pipelining's own schedule orders and CSVs.

Torch computes each rank's order in a method that reads only a few counts
from the schedule object, so it is called here on a plain namespace holding
those counts (no process group is involved).
"""

from types import SimpleNamespace

import pytest

from twobp.schedule import generate, load_csv, save_csv, to_rows

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_orders(cls, p: int, m: int, v: int) -> dict[int, list]:
    rounds = max(1, m // p)
    counts = SimpleNamespace(
        pp_group_size=p,
        _n_microbatches=m,
        n_local_stages=v,
        num_stages=p * v,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
    )
    return {r: cls._calculate_single_rank_operations(counts, r) for r in range(p)}


def compute_only(orders: dict[int, list]) -> list[list[str]]:
    return [[str(a) for a in orders[r] if a is not None] for r in sorted(orders)]


def ours(name: str, p: int, m: int, v: int | None = None) -> list[list[str]]:
    return to_rows(generate(name, p, m, stages_per_rank=v))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_zb_v_matches_torch(p, m):
    assert ours("zb-v", p, m) == compute_only(
        torch_orders(schedules.ScheduleZBVZeroBubble, p, m, 2)
    )


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_zb_h1_matches_torch_interleaved_zero_bubble_with_one_stage(p, m):
    expected = compute_only(torch_orders(schedules.ScheduleInterleavedZeroBubble, p, m, 1))
    assert ours("zb-h1", p, m) == expected


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_1f1b_matches_torch(p, rounds, v):
    m = p * rounds
    expected = compute_only(torch_orders(schedules.ScheduleInterleaved1F1B, p, m, v))
    assert ours("interleaved-1f1b", p, m, v) == expected


@pytest.mark.parametrize(
    ("cls", "name", "v"),
    [
        (schedules.ScheduleZBVZeroBubble, "zb-v", 2),
        (schedules.ScheduleInterleaved1F1B, "interleaved-1f1b", 2),
        (schedules.ScheduleInterleavedZeroBubble, "zb-h1", 1),
    ],
)
def test_reads_csv_written_by_torch(tmp_path, cls, name, v):
    path = tmp_path / f"{name}.csv"
    torch_schedule = SimpleNamespace(pipeline_order=torch_orders(cls, 3, 6, v))
    schedules.PipelineScheduleMulti._dump_csv(torch_schedule, path)
    assert path.read_text().splitlines()[1].startswith(",")  # torch writes idle steps empty
    loaded = load_csv(path)
    expected = generate(name, 3, 6, stages_per_rank=v)
    assert (loaded.placement, loaded.n_microbatches, loaded.actions) == (
        expected.placement,
        expected.n_microbatches,
        expected.actions,
    )


def test_torch_parses_our_csv(tmp_path):
    path = tmp_path / "zbv.csv"
    s = generate("zb-v", 2, 4)
    save_csv(s, path, aligned=True)
    rows = path.read_text().splitlines()
    parsed = [[schedules._Action.from_str(c) for c in row.split(",")] for row in rows]
    assert [[str(a) for a in row if a is not None] for row in parsed] == [
        [str(a) for a in s.actions[r]] for r in (0, 1)
    ]


def test_torch_zbv_file_for_p2_m2(tmp_path):
    # The sample that test_schedule_csv reads without torch.
    path = tmp_path / "zbv.csv"
    torch_schedule = SimpleNamespace(
        pipeline_order=torch_orders(schedules.ScheduleZBVZeroBubble, 2, 2, 2)
    )
    schedules.PipelineScheduleMulti._dump_csv(torch_schedule, path)
    assert path.read_text() == (
        "0F0,0F1,,3F0,3I0,3W0,3F1,3I1,3W1,0I0,0W0,,,,0I1,0W1,,\n"
        ",1F0,2F0,1F1,2F1,2I0,2W0,,1I0,1W0,,2I1,2W1,1I1,,,1W1,,\n"
    )


def flattened(orders: dict[int, list]) -> list[list[str]]:
    """Compute actions of every rank; torch's overlapped F and B as the two it runs, in order."""
    return [
        [str(s) for a in orders[r] if a is not None for s in (a.sub_actions or (a,))]
        for r in sorted(orders)
    ]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 2, 5, 8])
def test_dualpipev_matches_torch(p, extra):
    m = 2 * p + extra
    assert ours("dualpipev", p, m) == flattened(torch_orders(schedules.ScheduleDualPipeV, p, m, 2))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("extra", [0, 2, 6])
def test_each_dualpipe_rank_runs_torch_dualpipev_of_half_the_ranks(p, extra):
    # Rank r and its mirror p-1-r run rank min(r, p-1-r) of DualPipeV over p/2 ranks
    # and m/2 micro-batches: near stage (r's own pipeline entering at its end) and far one.
    m = 2 * p + extra
    half = torch_orders(schedules.ScheduleDualPipeV, p // 2, m // 2, 2)
    s = generate("dualpipe", p, m)
    for r in range(p):
        h = min(r, p - 1 - r)
        down, up = (r, 0), (2 * p - 1 - r, m // 2)
        near, far = (down, up) if r < p // 2 else (up, down)
        expected = []
        for a in (x for x in half[h] if x is not None for x in (x.sub_actions or (x,))):
            stage, first = near if a.stage_index == h else far
            expected.append(f"{stage}{a.computation_type.value}{first + a.microbatch_index}")
        assert [str(a) for a in s.actions[r]] == expected, r


def test_reads_torch_dualpipev_csv_with_overlapped_cells(tmp_path):
    path = tmp_path / "dualpipev.csv"
    torch_schedule = SimpleNamespace(
        pipeline_order=torch_orders(schedules.ScheduleDualPipeV, 2, 6, 2)
    )
    schedules.PipelineScheduleMulti._dump_csv(torch_schedule, path)
    assert "OVERLAP_F_B" in path.read_text()
    loaded = load_csv(path)
    expected = generate("dualpipev", 2, 6)
    assert (loaded.placement, loaded.n_microbatches, loaded.actions) == (
        expected.placement,
        expected.n_microbatches,
        expected.actions,
    )
