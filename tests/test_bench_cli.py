"""`twobp bench --quick` end to end: two real ranks, twobp and torch.distributed.pipelining."""

import json

import pytest

from twobp.cli.main import main
from twobp_bench import build_variants, resolve
from twobp_bench.config import BenchConfig


def test_quick_bench_writes_every_variant(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())
    png = (out / "throughput.png").read_bytes()
    assert png.startswith(b"\x89PNG")

    plan = resolve(BenchConfig(quick=True))
    expected = [
        v.label for v in build_variants(plan.schedules, plan.torch_schedules, plan.policies)
    ]
    (regime,) = results["regimes"]
    (group,) = regime["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    assert list(variants) == expected
    for label in expected:
        assert label in report

    # Every default variant runs at m = 2 (not torch's DualPipeV, which needs m >= 2p).
    ran = [v for v in variants.values() if v["skipped"] is None]
    assert len(ran) == len(expected)
    for v in ran:
        assert v["step_s"]["n"] == results["rounds"]
        assert v["step_s"]["median"] > 0
        # Every variant computes the gradients of the same model on the same batch:
        # each parameter's gradient, not only their norm.
        assert v["grad_rel_error"] < 1e-4, v["label"]
        assert all(b > 0 for b in v["peak_step_bytes"]), v["label"]
    bounds = group["reference_bounds_s"]
    for name, bound in bounds.items():
        # A bound is the reference's median time over p = 2 ranks.
        assert bound == variants[f"reference {name}"]["step_s"]["median"] / 2
    for v in ran:
        if v["framework"] == "reference":
            continue
        median = v["step_s"]["median"]
        assert v["efficiency"] == {
            n: pytest.approx(b / median, rel=1e-12) for n, b in bounds.items()
        }
        if "sim_step_s" in v:
            assert v["sim_error"] == pytest.approx(v["sim_step_s"] / median - 1, rel=1e-12)
            assert v["replay_error"] == pytest.approx(v["replay_step_s"] / median - 1, rel=1e-12)
    for label in ("twobp 1f1b", "twobp 1f1b+2bp", "twobp zb-v"):
        assert 0 <= variants[label]["bubble_ratio"] < 1
        assert variants[label]["sim_step_s"] > 0
        assert 0 < variants[label]["sim_busy_s"] <= variants[label]["sim_step_s"]
        assert 0 < variants[label]["busy_s"] <= variants[label]["step_s"]["high"]
        # Replaying the measured actions through the simulator gives back about the step time.
        assert 0 < variants[label]["replay_step_s"] <= 2 * variants[label]["step_s"]["high"]
    assert variants["twobp 1f1b+2bp"]["stashed_bytes"][1] > 0
    # What a send holds its sender, from twobp's own steps (each inside a step of its
    # variant), charged by the simulator.
    twobp_steps = [v["step_s"]["high"] for v in ran if v["label"].startswith("twobp ")]
    assert 0 < group["send_overhead_s"] < max(twobp_steps)
    assert "A send to another rank holds its sender" in report
    assert set(group["reference_bounds_s"]) == {"microbatched", "whole-batch", "2bp-limit"}
    printed = capsys.readouterr().out
    assert "report in" in printed
    # The summary gives the table's statistic: the median of paired rounds, with its spread.
    (two_bp,) = [line for line in printed.splitlines() if "1f1b: 2BP / no 2BP = " in line]
    assert " of 2 rounds]" in two_bp and "[IQR " in two_bp
    assert "inf" not in printed and "inf " not in report


def test_bad_option_is_refused_before_any_rank_starts(tmp_path, capsys):
    assert main(["bench", "--quick", "--schedules", "nope", "--out", str(tmp_path)]) == 2
    assert "--schedules" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


def test_overhead_mode_against_a_baseline_revision(tmp_path):
    # The baseline is this checkout's HEAD: its Pipeline runs next to this one, in the same group.
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--overhead", "--baseline", "HEAD", "--no-references",
            "--cprofile", "baseline 1f1b+2bp", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    (group,) = results["regimes"][0]["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    assert list(variants) == [
        f"{framework} 1f1b{policy}"
        for framework in ("twobp", "baseline")
        for policy in ("", "+2bp", "+2bp:eager")
    ]
    for v in variants.values():
        assert v["skipped"] is None and v["grad_rel_error"] < 1e-4, v["label"]
        assert all(c > 0 for c in v["cpu_s"]) and len(v["rank_bubble"]) == 2
        assert {"F", "B"} <= set(v["rank_compute_s"][0])
    assert [p["baseline"] for p in group["against_baseline"]] == list(variants)[3:]
    assert "## twobp against its baseline (git revision `HEAD`)" in (out / "report.md").read_text()
    profiles = sorted(p.name for p in (out / "cprofile").iterdir())
    assert profiles == ["quick-m2-rank0.prof", "quick-m2-rank1.prof"]


def test_quick_bench_of_chimera_over_two_data_parallel_copies(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--schedules", "1f1b,chimera", "--torch-schedules", "1F1B",
            "--data-parallel", "2", "--no-simulate", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    (group,) = results["regimes"][0]["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    for label in ("twobp 1f1b", "twobp chimera", "twobp chimera+2bp"):
        assert variants[label]["skipped"] is None, label
        assert variants[label]["step_s"]["median"] > 0
        # Without the whole-batch reference the first variant is the baseline: Chimera's 4
        # replicas of every stage (2 pipelines x 2 copies) reduce to 1F1B's gradients.
        assert variants[label]["grad_rel_error"] < 1e-5, label
    assert variants["twobp 1f1b"]["grad_rel_error"] == 0.0
    for label in ("torch 1F1B", "reference whole-batch"):
        assert "runs twobp's own pipelines only" in variants[label]["skipped"]
    assert "Data parallel: 2 copies" in (out / "report.md").read_text()


def test_recompute_variants_fill_the_memory_table(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--schedules", "1f1b", "--torch-schedules", "", "--no-references",
            "--no-simulate", "--recompute", "off,derivatives", "--weight-group-size", "1",
            "--microbatches", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    (group,) = results["regimes"][0]["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    assert list(variants) == [
        "twobp 1f1b",
        "twobp 1f1b+2bp",
        "twobp 1f1b+rc:derivatives",
        "twobp 1f1b+2bp+rc:derivatives",
    ]
    for v in variants.values():
        assert v["grad_rel_error"] < 1e-4, v["label"]
    plain, rebuilt = variants["twobp 1f1b+2bp"], variants["twobp 1f1b+2bp+rc:derivatives"]
    for rank in range(2):
        assert rebuilt["memory"][rank]["stash"] < plain["memory"][rank]["stash"]
    report = (out / "report.md").read_text()
    assert "## Memory: schedule x 2BP x recompute (twobp)" in report
    assert "| 1f1b | 4 | on | derivatives |" in report


def test_quick_bench_measures_auto_against_the_fixed_schedules_on_one_copy(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--schedules", "1f1b,auto", "--torch-schedules", "1F1B",
            "--no-references", "--microbatches", "4", "--share-model",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["share_model"] is True
    (group,) = results["regimes"][0]["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    assert list(variants) == ["twobp 1f1b", "twobp 1f1b+2bp", "torch 1F1B", "twobp auto"]
    for v in variants.values():
        assert v["skipped"] is None and v["step_s"]["median"] > 0, v["label"]
        # On one copy too, each step starts from the same weights and leaves no gradient
        # to the next: every variant's gradients are the reference's.
        assert v["grad_rel_error"] < 1e-4, v["label"]
    auto = variants["twobp auto"]
    # What it chose, as it ran: its partition covers the model, a rank per stage.
    assert auto["chose"] and sum(auto["partition"]) == sum(variants["twobp 1f1b"]["partition"])
    assert set(auto["stage_ranks"]) == {0, 1}
    assert auto["sim_step_s"] > 0
    assert group["auto"]["best_fixed"] in ("twobp 1f1b", "twobp 1f1b+2bp")
    assert group["auto"]["speedup"]["median"] > 0
    (target,) = [t for t in results["targets"] if t["target"] == "best fixed twobp / auto"]
    assert target["value"] == group["auto"]["speedup"]["median"]
    assert f"`twobp auto` ran {auto['chose']}" in (out / "report.md").read_text()


def test_torch_runs_at_every_count_auto_m_chooses_among(tmp_path):
    from twobp.sim.search import microbatch_counts
    from twobp_bench.config import QUICK_REGIME

    out = tmp_path / "bench"
    argv = ["bench", "--quick", "--schedules", "auto-m", "--torch-schedules", "1F1B",
            "--no-references", "--no-simulate", "--microbatches", "4", "--rounds", "1",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    (group,) = results["regimes"][0]["groups"]
    ran = {v["label"]: v for v in group["variants"] if v["skipped"] is None}
    others = [k for k in microbatch_counts(QUICK_REGIME.microbatch_size * 4, 2) if k != 4]
    assert others
    assert set(ran) == {"twobp auto-m", "torch 1F1B", *(f"torch 1F1B m={k}" for k in others)}
    assert ran["torch 1F1B"]["cut_into"] == 4
    for k in others:
        assert ran[f"torch 1F1B m={k}"]["cut_into"] == k
    for label, v in ran.items():
        # The same batch, cut otherwise: the same gradients as the reference's.
        assert v["grad_rel_error"] < 1e-4, label
    # The report says torch ran at every count and that its best is the fastest of them.
    report = (out / "report.md").read_text()
    counts = ", ".join(str(k) for k in sorted(others))
    assert f"the other counts it chooses among (m = {counts}; labelled `m=K`)" in report
    assert "the best torch is the fastest of every count" in report
    fastest = min((v for v in ran.values() if v["framework"] == "torch"),
                  key=lambda v: v["step_s"]["median"])  # fmt: skip
    assert group["best"]["torch"] == fastest["label"]
    assert "also ran on the same batch cut into the other counts" in (out / "report.md").read_text()


def test_the_default_torch_schedules_leave_out_dualpipev_where_it_cannot_run(tmp_path):
    """At m = p = 2 torch's DualPipeV (2p stages) cannot run: the default list leaves it out
    of the group, rather than a variant that is always skipped; the other defaults run."""
    out = tmp_path / "bench"
    argv = ["bench", "--regimes", "quick", "--model", "llama", "--microbatches", "2",
            "--rounds", "1", "--schedules", "1f1b", "--deepspeed-schedules", "",
            "--no-references", "--no-simulate", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (group,) = json.loads((out / "results.json").read_text())["regimes"][0]["groups"]
    torch_labels = [v["label"] for v in group["variants"] if v["framework"] == "torch"]
    assert "torch 1F1B" in torch_labels and "torch DualPipeV" not in torch_labels


def test_partition_cuts_the_variants_with_that_many_stages(tmp_path):
    out = tmp_path / "bench"
    # Six blocks (embedding, 4 layers, head): the bench's own cut of 4 stages is 2-1-1-2.
    argv = ["bench", "--quick", "--overrides", "n_layers=4", "--schedules", "1f1b,zb-v",
            "--torch-schedules", "ZBVZeroBubble", "--no-references", "--no-simulate",
            "--partition", "1,1,1,3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    (group,) = results["regimes"][0]["groups"]
    cut = {v["label"]: v["partition"] for v in group["variants"] if v["skipped"] is None}
    # The V's four stages (twobp's and torch's alike) take the given cut; 1f1b's two its own.
    assert cut["twobp zb-v"] == cut["torch ZBVZeroBubble"] == [1, 1, 1, 3]
    assert cut["twobp 1f1b"] == [3, 3]
