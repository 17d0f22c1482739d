"""DeepSpeed's PipelineEngine as a peer in the bench: skipped with the reason where it does
not import, and, where it does, a 2-rank step with the gradients of the single-process model."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench_workers import regime_without_deepspeed
from twobp.cli.main import main
from twobp.runtime import launch
from twobp_bench.analysis import analyse_regime
from twobp_bench.config import BenchConfig, resolve
from twobp_bench.deepspeed_engine import NOT_INSTALLED
from twobp_bench.report import GRAD_TOLERANCE

INSTALLED = importlib.util.find_spec("deepspeed") is not None


def test_without_deepspeed_its_variant_is_skipped_with_the_reason_and_the_rest_runs():
    cfg = BenchConfig(
        quick=True, schedules=["1f1b"], torch_schedules=[], deepspeed_schedules=["1F1B"],
        without_2bp=True, policies=[], references=False, simulate=False, rounds=1,
    )  # fmt: skip
    plan = resolve(cfg)
    (regime,) = plan.regimes
    reports = launch(regime_without_deepspeed, 2, plan, regime, threads_per_rank=1)
    (group,) = analyse_regime(reports, 2)["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    assert list(variants) == ["twobp 1f1b", "deepspeed 1F1B"]
    assert variants["deepspeed 1F1B"]["skipped"] == f"rank 0: {NOT_INSTALLED}"
    assert variants["twobp 1f1b"]["step_s"]["n"] == 1
    assert group["best"]["deepspeed"] is None


@pytest.mark.skipif(not INSTALLED, reason="deepspeed is not installed (the test extra has it)")
def test_deepspeed_steps_with_the_reference_gradients_beside_torch(tmp_path):
    out = tmp_path / "bench"
    # Two warm-up rounds (--quick would allow one): the gradients checked are those of
    # DeepSpeed's second step, after its optimizer step has run once (at learning rate 0
    # the weights stay the reference's).
    argv = ["bench", "--regimes", "quick", "--microbatches", "2", "--schedules", "1f1b",
            "--policies", "", "--torch-schedules", "1F1B", "--deepspeed-schedules", "1F1B",
            "--no-simulate", "--warmup", "2", "--rounds", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    (group,) = results["regimes"][0]["groups"]
    variants = {v["label"]: v for v in group["variants"]}
    ours = variants["deepspeed 1F1B"]
    assert ours["skipped"] is None, ours["skipped"]
    assert ours["partition"] == variants["torch 1F1B"]["partition"]
    assert ours["step_s"]["n"] == 2 and ours["step_s"]["median"] > 0
    assert ours["grad_rel_error"] < min(1e-4, GRAD_TOLERANCE)
    assert all(0 < t < ours["step_s"]["median"] for t in ours["update_s"])
    assert group["best"]["deepspeed"] == "deepspeed 1F1B"
    assert group["best"]["deepspeed_speedup"]["median"] > 0
    report = (out / "report.md").read_text()
    assert "## twobp against torch.distributed.pipelining and DeepSpeed" in report
    assert "| deepspeed 1F1B |" in report
    (target,) = [t for t in results["targets"] if t["target"] == "best twobp / DeepSpeed"]
    assert target["value"] == group["best"]["deepspeed_speedup"]["median"]
