"""From rank records to figures, targets, markdown and chart, on made-up timings."""

import dataclasses
import json
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from twobp.partition.profiler import BlockCost
from twobp.schedule import generate
from twobp.schedule.two_bp import apply_two_bp
from twobp_bench import matrix
from twobp_bench.analysis import analyse_regime, gradient_error
from twobp_bench.chart import COLOURS, _colour
from twobp_bench.config import Regime
from twobp_bench.job import RankReport, VariantRecord
from twobp_bench.profile import RankProfile
from twobp_bench.report import GRAD_TOLERANCE, MIB, render_markdown
from twobp_bench.run import write_outputs
from twobp_bench.runner import gradient_sketch
from twobp_bench.simcheck import replayed_step
from twobp_bench.targets import evaluate

# Step seconds of each variant in three rounds (m = 2, batch 2 * 4 = 8 samples).
TIMES = {
    "twobp 1f1b": [2.0, 2.2, 2.0],
    "twobp 1f1b+2bp": [1.0, 1.0, 1.1],
    "torch 1F1B": [2.0, 2.0, 2.2],
    "torch DualPipeV": None,
    "reference microbatched": [3.0, 3.0, 3.0],
    "reference whole-batch": [1.8, 1.8, 1.8],
    "reference 2bp-limit": [2.0, 2.0, 2.0],
}
PEAK = {"twobp 1f1b": 1000, "twobp 1f1b+2bp": 1500, "torch 1F1B": 1200}


# A model of two parameters; torch's 1F1B differs from the others in one projection
# of "1.weight" by 0.1, 5% of that gradient's norm.
SKETCH = {"0.weight": (1.0, 0.5, -0.25), "1.weight": (2.0, 1.0, -1.0)}


def _sketch(variant: matrix.Variant, rank: int) -> dict[str, tuple[float, ...]]:
    sketch = dict(SKETCH)
    if variant.label == "torch 1F1B":
        sketch["1.weight"] = (2.0, 1.1, -1.0)
    if not variant.is_pipeline:
        return sketch  # every rank ran the whole model
    name = f"{rank}.weight"  # stage r (rank r) holds block r
    return {name: sketch[name]}


def _records(rank: int) -> list[VariantRecord]:
    variants = matrix.build_variants(["1f1b"], ["1F1B", "DualPipeV"], ["paper"])
    out = []
    for v in variants:
        times = TIMES[v.label]
        rec = VariantRecord(v, 2, (3, 3), matrix.placement(v, 2))
        if times is None:
            rec.skipped = "rank 0: ValueError: DualPipeV requires at least as many microbatches"
        else:
            rec.step_seconds = list(times)
            rec.bubble_ratios = [0.1, 0.2, 0.3] if v.framework == "twobp" else []
            rec.peak_step_bytes = PEAK.get(v.label, 2000) + rank
            rec.stashed_bytes = 300 if v.two_bp else None
            rec.grad_sketch = _sketch(v, rank)
            rec.parameter_bytes = 4000
        out.append(rec)
    return out


def _reports(name: str) -> list[RankReport]:
    regime = Regime(name, f"{name} micro-batches", {"seq_len": 64}, 4)
    return [
        RankReport(
            rank=r,
            regime=regime,
            model_config={"dim": 8, "seq_len": 64},
            block_kinds=["embedding", "body", "body", "body", "body", "head"],
            records=_records(r),
            profiles={},
            peak_rss_bytes=10_000_000,
            device="cpu",
            threads=1,
        )
        for r in range(2)
    ]


def _results(regimes: list[dict], **fields: object) -> dict:
    """The results document of a bench run of ``regimes`` on 2 ranks, with ``fields`` changed."""
    return {
        "command": "twobp bench --test",
        "machine": {"cpu": "CPU", "cores": 2, "torch": "x", "load_before": [1, 1, 1]}
        | {"load_after": [1, 1, 1]},
        "n_ranks": 2,
        "threads": 1,
        "rounds": 3,
        "warmup": 1,
        "wall_s": 1.0,
        "regimes": regimes,
        "targets": evaluate(regimes, 2),
    } | fields


@pytest.fixture
def results():
    return _results([analyse_regime(_reports("large"), 2)])


def test_figures_of_a_group(results):
    group = results["regimes"][0]["groups"][0]
    variants = {v["label"]: v for v in group["variants"]}
    assert group["batch_size"] == 8
    assert results["regimes"][0]["rows_per_gemm"] == 256
    two_bp = variants["twobp 1f1b+2bp"]
    assert two_bp["step_s"]["median"] == 1.0
    assert two_bp["samples_per_s"]["median"] == 8.0
    assert two_bp["bubble_ratio"] == pytest.approx(0.2)
    # Bounds are the references' times over p = 2.
    assert group["reference_bounds_s"] == pytest.approx(
        {"microbatched": 1.5, "whole-batch": 0.9, "2bp-limit": 1.0}
    )
    assert two_bp["efficiency"]["whole-batch"] == pytest.approx(0.9)
    (pair,) = group["two_bp_speedups"]
    assert pair["speedup"]["median"] == pytest.approx(2.0)
    assert pair["memory_ratio"] == pytest.approx(1501 / 1001)
    assert group["best"]["twobp"] == "twobp 1f1b+2bp"
    assert group["best"]["torch"] == "torch 1F1B"
    assert group["best"]["speedup"]["median"] == pytest.approx(2.0)
    assert variants["torch DualPipeV"]["skipped"].startswith("rank 0: ValueError")
    assert variants["torch 1F1B"]["grad_rel_error"] == pytest.approx(0.05)
    assert variants["twobp 1f1b+2bp"]["grad_rel_error"] == 0.0
    assert variants["twobp 1f1b+2bp"]["grad_norm"] == pytest.approx(math.sqrt(5.0))


def test_targets_report_met_and_missed(results):
    by_name = {t["target"]: t for t in results["targets"]}
    assert by_name["best twobp / best torch"]["met"] is True
    assert by_name["1f1b: 2BP / no 2BP"]["value"] == pytest.approx(2.0)
    assert by_name["efficiency vs whole-batch"]["value"] == pytest.approx(0.9)
    assert by_name["efficiency vs whole-batch"]["met"] is False
    # No profile, no simulator figure: no verdict.
    assert by_name["share within 10% of the simulator"]["met"] is None
    # twobp 1f1b+2bp's 1.0 s against the microbatched reference's 3.0 s over p = 2.
    bubble_free = by_name["step / bubble-free step"]
    assert bubble_free["value"] == pytest.approx(1.0 / 1.5)
    assert bubble_free["threshold"] == 1.05 and bubble_free["met"] is True


def _with_auto(times: list[float]) -> list[RankReport]:
    """The reports of the large regime with a ``schedule="auto"`` variant that took ``times``."""
    reports = _reports("large")
    for r, report in enumerate(reports):
        auto = VariantRecord(matrix.Variant("twobp", "auto"), 2, (3, 3), (0, 1))
        auto.step_seconds = list(times)
        auto.grad_sketch = _sketch(auto.variant, r)
        auto.peak_step_bytes = 1500
        auto.chose = "zb-h2 with 2BP (fill)"
        report.records.append(auto)
    return reports


@pytest.mark.parametrize(
    ("times", "value", "met"),
    # Against twobp 1f1b+2bp (1.0, 1.0, 1.1 s), round by round.
    # Faster than every fixed variant: still measured against them, not against itself.
    [
        ([1.02, 1.02, 1.1], 1.0 / 1.02, True),
        ([1.2, 1.25, 1.3], 1.0 / 1.2, False),
        ([0.8, 0.85, 0.9], 1.1 / 0.9, True),
    ],
)
def test_auto_is_measured_against_the_fastest_fixed_twobp_variant(times, value, met):
    results = _results([analyse_regime(_with_auto(times), 2)])
    group = results["regimes"][0]["groups"][0]
    assert group["auto"]["best_fixed"] == "twobp 1f1b+2bp"
    assert group["auto"]["chose"] == "zb-h2 with 2BP (fill)"
    by_name = {t["target"]: t for t in results["targets"]}
    target = by_name["best fixed twobp / auto"]
    assert target["value"] == pytest.approx(value)
    assert target["threshold"] == 0.97 and target["met"] is met
    ratio = group["auto"]["speedup"]
    assert target["detail"].endswith(f"rounds' IQR {ratio['q1']:.3f}-{ratio['q3']:.3f}")
    assert ratio["q1"] < ratio["q3"]
    text = render_markdown(results)
    assert "`twobp auto` ran zb-h2 with 2BP (fill); the fastest fixed variant" in text
    # Without auto in the run there is no such target.
    assert "best fixed twobp / auto" not in {
        t["target"] for t in _results([analyse_regime(_reports("large"), 2)])["targets"]
    }


def _simulator_target(variants: list[dict]) -> dict:
    """The simulator target of a small-regime group of twobp variants (figures as given)."""
    group = {
        "n_microbatches": 8,
        "variants": [
            {"label": f"twobp v{i}", "framework": "twobp", **v} for i, v in enumerate(variants)
        ],
        "best": {"twobp": None, "torch": None},
        "reference_bounds_s": {},
        "two_bp_speedups": [],
    }
    (simulator,) = [
        t
        for t in evaluate([{"name": "small", "groups": [group]}], 2)
        if t["target"].startswith("share within")
    ]
    return simulator


def test_the_simulator_target_is_the_share_of_variants_within_ten_percent():
    simulator = _simulator_target([{"sim_error": e} for e in [0.05, -0.09, -0.2, 0.1]])
    assert simulator["value"] == pytest.approx(0.75)
    assert simulator["threshold"] == 0.9 and simulator["met"] is False
    assert simulator["detail"] == "3 of 4 within 10%; worst 20.0% (m=8 twobp v2)"


def test_the_simulator_target_says_what_the_replays_and_busy_times_make_of_its_errors():
    # (simulator error, replay error, measured busy, simulated busy)
    figures = [(0.05, 0.02, 1.0, 1.0), (-0.2, -0.04, 1.2, 1.0), (-0.15, -0.12, 1.1, 1.0)]
    simulator = _simulator_target(
        [
            {"sim_error": e, "replay_error": r, "busy_s": busy, "sim_busy_s": sim_busy}
            for e, r, busy, sim_busy in figures
        ]
    )
    assert simulator["detail"] == (
        "1 of 3 within 10%; worst 20.0% (m=8 twobp v1); replay with the steps' own action "
        "times: 2 of 3 within; compute in steps 1.00-1.20x the profiled"
    )


def test_targets_carry_the_bound_the_run_allows(results):
    by_name = {t["target"]: t for t in results["targets"]}
    # torch 1F1B (median 2.0 s) against the whole-batch reference / p (0.9 s).
    assert by_name["best twobp / best torch"]["bound"] == pytest.approx(2.0 / 0.9)
    # Over the same micro-batches: the 2BP limit / p (1.0 s), faster than microbatched (1.5 s).
    assert by_name["best twobp / best torch"]["detail"].endswith(
        "; over the same micro-batches: 2.000"
    )
    # Without a profile there is no simulated ratio to bound 2BP's gain.
    assert by_name["1f1b: 2BP / no 2BP"]["bound"] is None
    assert "| 2.222 |" in render_markdown(results)


def test_markdown_json_and_chart_hold_every_variant(results, tmp_path):
    text = render_markdown(results)
    for label in TIMES:
        assert label in text
    assert "MISSED" in text and "DIFFERS" in text
    assert "| large (256 rows/GEMM) | 1f1b+2bp | 2 |" in text
    write_outputs(results, tmp_path)
    loaded = json.loads((tmp_path / "results.json").read_text())
    labels = [v["label"] for v in loaded["regimes"][0]["groups"][0]["variants"]]
    assert labels == list(TIMES)
    png = (tmp_path / "throughput.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_regimes_without_thresholds_get_no_verdict():
    regimes = [analyse_regime(_reports("preset"), 2)]
    assert all(t["met"] is None for t in evaluate(regimes, 2))


def _baseline_reports() -> list[RankReport]:
    """1f1b with and without 2BP on this twobp and on the baseline, and rank figures."""
    times = {
        "twobp 1f1b": [2.0, 2.0],
        "twobp 1f1b+2bp": [1.0, 1.0],
        "baseline 1f1b": [2.0, 2.0],
        "baseline 1f1b+2bp": [1.6, 1.5],
    }
    variants = matrix.build_variants(["1f1b"], [], ["paper"], references=(), baseline=True)

    def fill(rec: VariantRecord, rank: int) -> None:
        rec.step_seconds = list(times[rec.variant.label])
        rec.cpu_seconds = [0.5 + rank, 0.7 + rank]
        rec.rank_bubble_ratios = [[0.1, 0.3], [0.2, 0.4]]
        # Two timed rounds: per step, stage 0 (rank 0) F 10 ms, stage 1 (rank 1) F 20 ms.
        rec.action_seconds = {"0:F:1": [0.005] * 4, "1:F:1": [0.01] * 4, "1:W:2": [0.03] * 2}

    return _preset_reports(variants, fill)


def _preset_reports(
    variants: list[matrix.Variant], fill: Callable[[VariantRecord, int], None]
) -> list[RankReport]:
    """The reports of 2 ranks that ran ``variants`` (3-3 partition, 2 micro-batches) on a
    preset model, each record given its figures by ``fill(record, rank)``."""
    reports = []
    for rank in range(2):
        records = []
        for v in variants:
            rec = VariantRecord(v, 2, (3, 3), matrix.placement(v, 2))
            fill(rec, rank)
            records.append(rec)
        reports.append(
            RankReport(rank, Regime("preset", "a preset", {}, 4), {}, [], records, {}, 0, "cpu", 1)
        )
    return reports


def test_baseline_and_rank_figures_reach_the_report():
    regime = analyse_regime(_baseline_reports(), 2)
    (group,) = regime["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    ours = variants["twobp 1f1b+2bp"]
    assert ours["cpu_s"] == pytest.approx([0.6, 1.6])
    assert ours["rank_bubble"] == pytest.approx([0.15, 0.35])
    assert ours["rank_compute_s"] == [{"F": pytest.approx(0.01)}, {"F": 0.02, "W": 0.03}]
    # 2BP's speedup of each revision against its own fused schedule.
    pairs = {p["with"]: p["without"] for p in group["two_bp_speedups"]}
    assert pairs == {"twobp 1f1b+2bp": "twobp 1f1b", "baseline 1f1b+2bp": "baseline 1f1b"}
    (fused, split) = group["against_baseline"]
    assert (split["twobp"], split["baseline"]) == ("twobp 1f1b+2bp", "baseline 1f1b+2bp")
    assert split["speedup"]["median"] == pytest.approx(1.55)
    assert fused["speedup"]["median"] == pytest.approx(1.0)
    # The baseline is not a candidate for this twobp's best.
    assert group["best"]["twobp"] == "twobp 1f1b+2bp"

    text = render_markdown(
        _results([regime], command="twobp bench --baseline abc123", rounds=2, baseline="abc123")
    )
    assert "## twobp against its baseline (git revision `abc123`)" in text
    row = "| preset (4 samples/micro-batch) | 2 | twobp 1f1b+2bp | baseline 1f1b+2bp | 1.55x"
    assert row in text
    assert "| twobp 1f1b+2bp | 600 / 1600 | 15.0% / 35.0% | F 10 / 20, W 0 / 30 |" in text


def _model_gradients() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    model(torch.randn(5, 4)).square().mean().backward()
    return model


def test_grad_check_compares_every_parameter_and_fails_a_permuted_gradient():
    model = _model_gradients()
    want = gradient_sketch(model.named_parameters())
    assert list(want) == [n for n, _ in model.named_parameters()]
    assert gradient_error(gradient_sketch(model.named_parameters()), want) == 0.0
    # Rounding-sized differences pass.
    for p in model.parameters():
        p.grad.mul_(1 + 1e-7)
    assert gradient_error(gradient_sketch(model.named_parameters()), want) < GRAD_TOLERANCE

    def error_after(change) -> float:
        changed = _model_gradients()
        with torch.no_grad():
            change(dict(changed.named_parameters()))
        got = gradient_sketch(changed.named_parameters())
        # Every change keeps the global norm: a norm check would take it.
        total = math.sqrt(sum(s[0] ** 2 for s in got.values()))
        assert total == pytest.approx(math.sqrt(sum(s[0] ** 2 for s in want.values())))
        return gradient_error(got, want)

    def permute_entries(params):
        params["2.weight"].grad.copy_(params["2.weight"].grad.flatten().roll(1).view(3, 3))

    def swap_parameters(params):
        a, b = params["2.weight"].grad, params["4.weight"].grad
        a_copy = a.clone()
        a.copy_(b)
        b.copy_(a_copy)

    def transpose(params):
        params["4.weight"].grad.copy_(params["4.weight"].grad.t().clone())

    def negate(params):
        params["0.bias"].grad.neg_()

    for change in (permute_entries, swap_parameters, transpose, negate):
        assert error_after(change) > 0.1, change.__name__
    # A parameter missing from one side: no verdict of "same gradients".
    partial = dict(want)
    del partial["0.bias"]
    assert gradient_error(partial, want) == math.inf


def _memory_reports() -> list[RankReport]:
    """1f1b without and with 2BP and zb-v (split by itself), each with memory stats."""
    peaks = {"twobp 1f1b": 1000, "twobp 1f1b+2bp": 1500, "twobp zb-v": 1200}
    variants = matrix.build_variants(["1f1b", "zb-v"], [], ["paper"], references=())
    assert [v.label for v in variants] == list(peaks)

    def fill(rec: VariantRecord, rank: int) -> None:
        rec.step_seconds = [1.0, 1.0]
        rec.peak_step_bytes = peaks[rec.variant.label] * MIB + rank * MIB
        rec.memory = {"activations": (2 + rank) * MIB, "stash": (1 + rank) * MIB}

    return _preset_reports(variants, fill)


def test_memory_table_compares_a_peak_only_with_a_variant_without_2bp():
    regime = analyse_regime(_memory_reports(), 2)
    (group,) = regime["groups"]
    peaks = {v["label"]: v["memory_peaks"] for v in group["variants"]}
    assert peaks["twobp 1f1b"]["step_vs_no_2bp"] == pytest.approx(1.0)
    assert peaks["twobp 1f1b+2bp"]["step_vs_no_2bp"] == pytest.approx(1501 / 1001)
    assert peaks["twobp 1f1b+2bp"]["activations_bytes"] == 3 * MIB
    assert peaks["twobp 1f1b+2bp"]["stash_bytes"] == 2 * MIB
    # zb-v splits its backward by itself: no variant of it runs without 2BP.
    assert peaks["twobp zb-v"]["step_vs_no_2bp"] is None
    text = render_markdown(_results([regime], command="twobp bench", rounds=2))
    preset = "| preset (4 samples/micro-batch) |"
    assert f"{preset} 1f1b | 2 | on | - | 8.0 | 1501.0 | 1.50x | 3.0 | 2.0 |" in text
    assert f"{preset} zb-v | 2 | on | - | 8.0 | 1201.0 | n/a | 3.0 | 2.0 |" in text


def test_the_time_outside_a_schedule_is_added_to_the_replay():
    reports = _reports("large")
    run = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    seconds = {"0:F:1": [0.1], "0:B:1": [0.2], "1:F:1": [0.1], "1:B:1": [0.2]}
    for report in reports:
        for rec in report.records:
            if rec.variant.framework == "twobp":
                # The first rank's figures count: the ranks wait for each other at the end.
                rec.outside_seconds = [0.01, 0.02, 0.03] if report.rank == 0 else [9.0] * 3
                rec.run_actions, rec.action_seconds = run, seconds
    group = analyse_regime(reports, 2)["groups"][0]
    assert group["step_overhead_s"] == pytest.approx(0.02)
    schedule_only = replayed_step(run, (0, 1), 2, seconds, (0.0, math.inf)).makespan
    replayed = [v for v in group["variants"] if v["framework"] == "twobp"]
    assert len(replayed) == 2
    for v in replayed:
        assert v["replay_step_s"] == pytest.approx(schedule_only + 0.02)


def test_the_time_outside_a_schedule_is_added_to_the_simulated_step():
    reports = _reports("large")
    blocks = tuple(BlockCost(i, "Block", 0.1, 0.1, 0.1, 0.2, 0, 0, 0, 0) for i in range(6))
    profile = RankProfile(blocks, tuple({1: 0.1} for _ in blocks), 0.0, math.inf)
    for report in reports:
        report.profiles[2] = profile
        for rec in report.records:
            if rec.variant.framework == "twobp":
                fused = generate("1f1b", 2, 2)
                rec.schedule = apply_two_bp(fused) if rec.variant.two_bp else fused
                rec.outside_seconds = [0.05]
    without = {
        v["label"]: v["sim_step_s"]
        for v in analyse_regime(_reports_with(reports, 0.0), 2)["groups"][0]["variants"]
        if v.get("sim_step_s") is not None
    }
    group = analyse_regime(reports, 2)["groups"][0]
    simulated = [v for v in group["variants"] if v.get("sim_step_s") is not None]
    assert len(simulated) == 2
    for v in simulated:
        assert v["sim_step_s"] == pytest.approx(without[v["label"]] + 0.05)


def _reports_with(reports: list[RankReport], outside: float) -> list[RankReport]:
    """The same reports, every twobp step ``outside`` seconds outside its schedule."""
    out = []
    for report in reports:
        records = [dataclasses.replace(r) for r in report.records]
        for rec in records:
            if rec.variant.framework == "twobp":
                rec.outside_seconds = [outside]
        out.append(dataclasses.replace(report, records=records))
    return out


def test_the_report_gives_the_measured_all_reduce_bandwidth_once():
    reports = _reports("large")
    blocks = tuple(BlockCost(i, "Block", 0.1, 0.1, 0.1, 0.2, 0, 0, 0, 0) for i in range(6))
    profile = RankProfile(blocks, tuple({1: 0.1} for _ in blocks), 0.0, math.inf, 1, 1.0, 1.5e9)
    for report in reports:
        report.profiles[2] = profile
    results = _results([analyse_regime(reports, 2)])
    text = render_markdown(results)
    assert text.count("An all-reduce over every rank moved 1.50 GB/s per rank") == 1
    # The ping-pong's bandwidth was too fast to time (inf): said so, and JSON has no inf.
    assert "bandwidth not measured" in text and "inf" not in text
    json.dumps(results, allow_nan=False)


def test_a_target_is_shown_as_the_median_of_paired_rounds_with_its_spread(results):
    """The console summary and the report's targets give the paper table's statistic: the
    median of the rounds' paired ratios (not a ratio of medians), with its IQR."""
    from twobp_bench.targets import shown_value

    by_name = {t["target"]: t for t in results["targets"]}
    # Rounds 2.0/1.0, 2.2/1.0, 2.0/1.1: median 2.0, quartiles 1.91 and 2.10.
    assert shown_value(by_name["1f1b: 2BP / no 2BP"]) == "2.000 [IQR 1.91-2.10 of 3 rounds]"
    assert "2.000 [IQR 1.91-2.10 of 3 rounds]" in render_markdown(results)
    # Figures that are not ratios of rounds are shown alone.
    assert shown_value(by_name["efficiency vs whole-batch"]) == "0.900"


def test_deepspeed_stands_beside_torch_in_the_figures_the_report_and_the_chart(tmp_path):
    times = {
        "twobp 1f1b": [2.0, 2.0],
        "twobp 1f1b+2bp": [1.0, 1.0],
        "torch 1F1B": [2.0, 2.2],
        "deepspeed 1F1B": [1.5, 1.6],
    }
    variants = matrix.build_variants(
        ["1f1b"], ["1F1B"], ["paper"], references=(), deepspeed_schedules=["1F1B"]
    )
    assert [v.label for v in variants] == list(times)

    def fill(rec: VariantRecord, rank: int) -> None:
        rec.step_seconds = list(times[rec.variant.label])
        if rec.variant.framework == matrix.DEEPSPEED:
            rec.update_seconds = [0.01 + rank * 0.01, 0.01 + rank * 0.01]

    regime = analyse_regime(_preset_reports(variants, fill), 2)
    (group,) = regime["groups"]
    deepspeed = {v["label"]: v for v in group["variants"]}["deepspeed 1F1B"]
    assert deepspeed["stage_ranks"] == [0, 1]
    assert deepspeed["update_s"] == pytest.approx([0.01, 0.02])
    best = group["best"]
    assert (best["torch"], best["deepspeed"]) == ("torch 1F1B", "deepspeed 1F1B")
    assert best["speedup"]["median"] == pytest.approx(2.1)
    assert best["deepspeed_speedup"]["median"] == pytest.approx(1.55)
    results = _results([regime], command="twobp bench", rounds=2)
    (target,) = [t for t in results["targets"] if t["target"] == "best twobp / DeepSpeed"]
    assert target["value"] == pytest.approx(1.55)
    text = render_markdown(results)
    assert "## twobp against torch.distributed.pipelining and DeepSpeed" in text
    row = (
        "| preset (4 samples/micro-batch) | 2 | twobp 1f1b+2bp | 8.0 | torch 1F1B | 3.8 | "
        "2.10x [2.05-2.15] | deepspeed 1F1B | 5.2 | 1.55x [1.52-1.58] |"
    )
    assert row in text
    assert "The update took, per rank (rank 0 / rank 1 / ...): preset, m = 2: 10.0 / 20.0" in text
    write_outputs(results, tmp_path)
    assert (tmp_path / "throughput.png").read_bytes().startswith(b"\x89PNG")
    assert _colour({"framework": "deepspeed", "two_bp": False}) == COLOURS["deepspeed"]


def test_auto_that_chooses_the_count_is_an_auto_variant_not_a_fixed_one():
    # auto-m, faster than every variant, is the auto side; the fixed side stays 1f1b+2bp.
    reports = _with_auto([1.2, 1.25, 1.3])
    for r, report in enumerate(reports):
        chosen = VariantRecord(matrix.Variant("twobp", matrix.AUTO_MICROBATCHES), 2, (3, 3), (0, 1))
        chosen.step_seconds = [0.8, 0.85, 0.9]
        chosen.grad_sketch = _sketch(chosen.variant, r)
        chosen.peak_step_bytes = 1500
        chosen.chose = "zb-v with 2BP (paper), m=4"
        report.records.append(chosen)
    group = _results([analyse_regime(reports, 2)])["regimes"][0]["groups"][0]
    assert group["auto"]["best_fixed"] == "twobp 1f1b+2bp"
    assert group["auto"]["auto"] == "twobp auto-m"
    # Round by round: 1.0 / 0.8, 1.0 / 0.85, 1.1 / 0.9.
    assert group["auto"]["speedup"]["median"] == pytest.approx(1.1 / 0.9)
    # auto-m runs micro-batches of its own: not a step over the group's micro-batches.
    results = _results([analyse_regime(reports, 2)])
    (bubble_free,) = [t for t in results["targets"] if t["target"] == "step / bubble-free step"]
    assert bubble_free["value"] == pytest.approx(1.0 / 1.5)
