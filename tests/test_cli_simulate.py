"""``twobp simulate`` and ``twobp plan`` through the real entry point."""

import json
import struct

from twobp.cli.main import main
from twobp.sim.cost_io import save_costs
from twobp.sim.costs import CostModel


def test_simulate_prints_grid_and_figures(capsys):
    code = main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "4"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "1f1b: makespan 21, bubble ratio 42.9% (1 column = 1)"
    assert lines[1] == "rank 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0~~~ .  B1~~~ .  B2~~~ .  B3~~~"
    assert "makespan 21 time units (0.1905 micro-batches per time unit)" in out
    assert "bubble ratio 42.9%" in out
    # rank, busy, idle, bubble, peak memory: rank 0 holds all 4 micro-batches.
    assert "   0        12         9    42.9%            4" in out
    assert "   3        12         9    42.9%            1" in out


def test_simulate_two_bp_costs_png_and_trace(tmp_path, capsys):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    code = main(
        [
            "simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2",
            "--policy", "paper", "--costs", "F=1,I=1,W=1,latency=0.5",
            "--png", str(png), "--trace", str(trace),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("gpipe+2bp:paper: ")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, _ = struct.unpack(">II", png.read_bytes()[16:24])
    assert width == 1200
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    # 2 ranks x (2 F + 2 I) + one concatenated W per rank.
    assert len(events) == 10
    assert f"wrote {png}" in out and f"wrote {trace}" in out


def test_simulate_reads_a_profile(tmp_path, capsys):
    path = tmp_path / "profile.json"
    save_costs(CostModel.uniform(2, f=2, i=2, w=2), path)
    code = main(
        ["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "1",
         "--costs-file", str(path)]
    )  # fmt: skip
    assert code == 0
    # F + F + B + B with F = 2, B = 4.
    assert "makespan 12 s (0.08333 micro-batches per s)" in capsys.readouterr().out


def test_simulate_error_is_one_clear_line(capsys):
    code = main(
        ["simulate", "--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "6"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("twobp simulate: ")


def test_plan_ranks_marks_and_recommends(capsys):
    code = main(
        ["plan", "--stages", "4", "--microbatches", "8", "--memory-limit", "6",
         "--schedules", "1f1b,zb-h1,gpipe", "--policies", "off,paper"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    # The one ranking of both planners: those within the limit first, fastest first
    # (zb-h1 at 27 with memory 4, the fused 1f1b at 33), then those over it, fastest first.
    assert [(r[1], r[2], r[3]) for r in rows[:3]] == [
        ("zb-h1", "off", "27"),
        ("1f1b", "off", "33"),
        ("1f1b", "paper", "27"),
    ]
    assert [r[3] for r in rows] == ["27", "33", "27", "27", "30", "33"]
    assert ["over" in r for r in rows] == [False, False, True, True, True, True]
    over = [(r[1], r[2]) for r in rows if "over" in r]
    assert ("1f1b", "paper") in over and ("gpipe", "off") in over
    assert ("zb-h1", "off") not in over
    assert (
        out.strip()
        .splitlines()[-2]
        .startswith("Recommended: zb-h1: the shortest simulated step (27")
    )
    # The last line: what schedule='auto' would run on these costs (one pipeline, no Chimera).
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("schedule='auto' on these costs would run zb-h1 (simulated step 27")
    )


def test_plan_recommends_two_bp_when_memory_allows(capsys):
    code = main(
        ["plan", "--stages", "4", "--microbatches", "4", "--schedules", "1f1b",
         "--policies", "off,eager,paper"]
    )  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-2]
    assert code == 0
    # 1F1B 21 -> 15 with the paper placement: 1.40x.
    assert last == (
        "Recommended: 1f1b with 2BP (paper): the shortest simulated step (15, 1.40x the "
        "throughput of 1f1b without 2BP) with a peak memory per rank of 4 micro-batch "
        "activations (no memory limit given)."
    )


def test_plan_gives_every_figure_its_unit(capsys):
    argv = ["plan", "--stages", "8", "--microbatches", "16", "--memory-limit", "12"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(
        "8 ranks, 16 micro-batches, memory limit 12 micro-batch activations per rank; times in "
        "the unit of --costs' F, memory in micro-batch activations"
    )
    assert "peak memory (activations)" in lines[1]
    assert lines[-2].startswith("Recommended: dualpipe: ")
    assert lines[-2].endswith(
        "whose peak memory per rank, 9 micro-batch activations, fits the limit of 12 micro-batch "
        "activations."
    )
    # schedule='auto' runs one pipeline: where it runs another schedule, it says why.
    assert lines[-1].startswith("schedule='auto' on these costs would run zb-v (")
    assert lines[-1].endswith(
        "not dualpipe, which runs two pipelines over the same ranks: schedule='auto' tries one "
        "pipeline per schedule (pass the name to run it)"
    )
    # With sizes in bytes, memory is in bytes.
    argv += ["--costs", "F=1,I=1,W=1,act=1GiB"]
    argv[argv.index("12")] = "40GiB"
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "memory limit 40 GiB per rank" in lines[0] and "memory in bytes" in lines[0]
    assert lines[-2].endswith("fits the limit of 40 GiB.")


def test_plan_refuses_a_byte_limit_for_costs_without_sizes(capsys):
    argv = ["plan", "--stages", "8", "--microbatches", "16", "--memory-limit", "40GiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "--memory-limit 40GiB is a size in bytes, but these costs count memory in micro-batch"
        in err
    )
    assert "act=" in err and "--costs-file" in err and "Traceback" not in err


def test_plan_gives_fill_the_memory_limit(capsys):
    # Unit memory: activations 1 per micro-batch until I, stash 1 from I until
    # W. With 5 per rank, fill runs W early enough to stay at 5; paper holds 8.
    code = main(
        ["plan", "--stages", "4", "--microbatches", "8", "--memory-limit", "5",
         "--schedules", "1f1b,gpipe", "--policies", "off,paper,fill"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    rows = {(r[1], r[2]): r for r in (line.split() for line in out.splitlines()) if r[:1]}
    assert rows[("1f1b", "fill")][3:6] == ["27", "1.00x", "11.1%"]
    assert rows[("1f1b", "fill")][6] == "5" and "over" not in rows[("1f1b", "fill")]
    assert "over" in rows[("1f1b", "paper")]
    # GPipe's warm-up alone holds 8: the limit cannot be met, and the row says why.
    assert "needs at least 8 per rank, whatever the W placement" in out
    assert out.strip().splitlines()[-2].startswith("Recommended: 1f1b with 2BP (fill)")


def test_plan_speaks_of_memory_in_the_limit_unit_per_rank(capsys):
    # Interleaved 1F1B holds 2 stages per rank, each with half the rank's memory
    # per micro-batch: its warm-up alone keeps 11 half-size activations on rank 0.
    argv = ["plan", "--microbatches", "8", "--memory-limit", "5", "--policies", "fill"]
    assert main([*argv, "--schedules", "interleaved-1f1b"]) == 0
    out = capsys.readouterr().out
    assert "needs at least 5.5 per rank, whatever the W placement" in out
    assert "the limit is 5" in out and "memory_limit=" not in out


def test_plan_nothing_fits(capsys):
    main(["plan", "--microbatches", "4", "--memory-limit", "0.5", "--schedules", "1f1b,gpipe"])
    last = capsys.readouterr().out.strip().splitlines()[-2]
    assert last.startswith("No schedule fits memory_limit=0.5 per rank: ")


def test_plan_lists_schedules_it_cannot_build(capsys):
    main(["plan", "--microbatches", "6", "--schedules", "1f1b,interleaved-1f1b",
          "--policies", "off"])  # fmt: skip
    out = capsys.readouterr().out
    assert "interleaved-1f1b  off" in out and "n/a:" in out


def test_plan_markdown(capsys):
    main(["plan", "--microbatches", "4", "--schedules", "1f1b", "--policies", "off,paper",
          "--markdown"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| # | schedule | 2BP | makespan |" in out
    assert "| 1 | 1f1b | paper | 15 | 1.00x | 20.0% | 4 |  |" in out


def test_plan_unknown_policy(capsys):
    assert main(["plan", "--policies", "off,lazy"]) == 2
    assert "argument --policies: invalid choice: 'lazy'" in capsys.readouterr().err


def test_plan_compares_recompute_modes_and_w_group_caps(capsys):
    argv = ["plan", "--stages", "2", "--microbatches", "8", "--schedules", "1f1b",
            "--policies", "paper", "--costs", "F=1,I=1,W=1,act=4,grad=4,send=1",
            "--recompute", "off,derivatives", "--weight-group-sizes", "1",
            "--memory-limit", "24"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    rows = {(r[7], r[8]): r for r in table}
    assert set(rows) == {("off", "-"), ("off", "1"), ("derivatives", "-"), ("derivatives", "1")}
    # Derivatives hold input and output gradient (2) per micro-batch instead of the stash
    # (4), and W rebuilds one micro-batch's stash at a time: F and I again inside W.
    assert float(rows[("derivatives", "1")][3]) > float(rows[("off", "-")][3])
    assert "over" in rows[("off", "-")] and "over" not in rows[("derivatives", "1")]
    assert (
        out.strip()
        .splitlines()[-2]
        .startswith(
            "Recommended: 1f1b with 2BP (paper), recompute='derivatives', weight_group_size=1"
        )
    )
    assert main(["plan", "--recompute", "some"]) == 2
    assert "argument --recompute: invalid choice: 'some'" in capsys.readouterr().err


def test_plan_rebuilds_only_what_does_not_fit(capsys):
    argv = ["plan", "--stages", "2", "--microbatches", "4", "--schedules", "1f1b",
            "--policies", "paper", "--costs", "F=1,I=1,W=1,act=1,grad=1,send=0.25",
            "--recompute", "off,auto", "--memory-limit", "3.5"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("3.5  auto (2 rebuilt)" in line for line in lines), lines
    assert lines[-2].startswith("Recommended: 1f1b with 2BP (paper), recompute='auto' (2 rebuilt)")
    assert lines[-1].startswith("schedule='auto', recompute='auto', on these costs would run 1f1b")


def test_simulate_reduces_replicated_stages(capsys):
    def run(*extra):
        assert main(["simulate", "--stages", "2", "--microbatches", "4", *extra]) == 0
        return capsys.readouterr().out

    costs = ["--costs", "F=1,I=1,W=1,param=4,bandwidth=1"]
    # Chimera holds each stage on both ranks: its R all-reduce 4 bytes at 1 byte/s, after
    # the compute (14) ends.
    chimera = run("--schedule", "chimera", *costs)
    assert chimera.splitlines()[0].startswith("chimera: makespan 20,")
    assert "gradient all-reduces (R, in the background, not drawn) end at: rank 0 20" in chimera
    # One pipeline reduces only with copies.
    assert "all-reduces" not in run("--schedule", "1f1b", *costs)
    copies = run("--schedule", "1f1b", "--data-parallel", "2", *costs)
    assert "gradient all-reduces (R, in the background, not drawn) end at:" in copies


def test_plan_with_a_sharded_optimizer_holds_a_share_of_its_state(capsys):
    common = ["plan", "--stages", "4", "--microbatches", "8", "--schedules", "1f1b",
              "--policies", "off", "--costs", "F=1,I=1,W=1,param=4,opt=16,bandwidth=10",
              "--data-parallel", "8"]  # fmt: skip
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main([*common, "--shard-optimizer"]) == 0
    sharded = capsys.readouterr().out
    assert "optimizer sharded over them" in sharded
    # The optimizer state, 16 a stage unsharded, is 16 / 8 = 2 a rank once sharded.
    assert "peak memory per rank of 24 " in plain.replace("\n", " ")
    assert "peak memory per rank of 10 " in sharded.replace("\n", " ")
    assert "memory in bytes" in plain


def test_the_auto_line_says_when_the_table_s_pick_is_not_among_auto_s_options():
    from twobp.cli.plan import _why_auto_differs
    from twobp.sim.candidate import Candidate

    plain = Candidate("1f1b", "paper", makespan=12.0, peak_memory=4.0, stages_per_rank=1)
    recomputed = Candidate(
        "1f1b", "paper", makespan=10.0, peak_memory=4.0, stages_per_rank=1,
        recompute="derivatives",
    )  # fmt: skip
    said = _why_auto_differs(plain, [plain], [recomputed, plain], None)
    assert said == (
        "; the table's pick, 1f1b with 2BP (paper), recompute='derivatives', is not among the "
        "options schedule='auto' tries (no recompute mode but 'auto', no weight_group_size)"
    )
    # Among auto's options and slower: the near-tie rule chose.
    close = Candidate("zb-h1", "off", makespan=11.9, peak_memory=4.0, stages_per_rank=1)
    assert "ties with it within 2%" in _why_auto_differs(plain, [plain, close], [close], None)
    assert _why_auto_differs(plain, [plain], [plain], None) == ""
