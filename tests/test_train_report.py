"""What the report of a `twobp train --schedule auto` run says ran, and the config it leaves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from twobp.cli.main import main
from twobp.config import read_toml
from twobp.train.config import TrainConfig
from twobp.train.preflight import check_config


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("auto") / "run"
    code = main(
        [
            "train", "--ranks", "4", "--data-parallel", "2", "--schedule", "auto",
            "--auto-trials", "2", "--recompute", "activations", "--steps", "5",
            "--log-every", "2", "--batch-size", "16", "--microbatches", "4",
            "--seq-len", "16", "--threads", "1", "--timeout", "120", "--no-save",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    return out, json.loads((out / "metrics.json").read_text())


def test_the_report_names_autos_choice_copies_recompute_precision_and_scaler(auto_run):
    out, metrics = auto_run
    ran = metrics["ran"]
    assert ran["schedule"] != "auto" and ran["data_parallel"] == 2
    assert ran["recompute"] == "activations" and ran["precision"] == "float32"
    assert ran["scaler"] == "none"
    auto = ran["auto"]
    assert auto["choice"].startswith(ran["schedule"])
    assert auto["predicted_step_s"] > 0
    # Measured in trial steps where other contenders came close enough to try.
    assert (auto["measured_step_s"] or 0) > 0 or auto["tried"] == 0
    report = (out / "report.md").read_text()
    assert f"- schedule: {ran['schedule']} " in report and "2 data-parallel copies" in report
    assert "recompute: activations" in report
    assert f"- chosen by schedule='auto': {auto['choice']}, predicted step " in report
    assert ("ms in trial steps" in report) == (auto["measured_step_s"] is not None)
    assert report.startswith(f"# twobp train: llama-tiny {ran['schedule']}")
    assert "- precision: float32; gradient scaler: none" in report


def test_every_rank_row_shows_its_stages_copies_included(auto_run):
    out, metrics = auto_run
    stages = metrics["stages_per_rank"]
    assert set(stages) == {"0", "1", "2", "3"}
    assert stages["0"] == stages["2"] and stages["1"] == stages["3"]  # the copies' ranks
    rows = [line for line in (out / "report.md").read_text().splitlines() if line[:3] == "| 2"]
    assert rows and ": " in rows[0].split("|")[2], rows


def test_bubble_is_a_median_and_held_out_loss_and_step_times_are_reported(auto_run):
    out, metrics = auto_run
    assert metrics["bubble_ratio_steps"] >= 1
    assert 0 <= metrics["bubble_ratio"] < 1
    assert [step for step, _ in metrics["eval_losses"]] == [2, 4, 5]
    times = metrics["step_times_per_rank"]
    assert set(times) == {"0", "1", "2", "3"}
    assert all(t["compute"] > 0 and t["receives"] > 0 for t in times.values())
    assert (
        "| rank | compute | dispatch | sending | receiving | sends | receives | W parts in "
        "waits | waited with W queued |" in (out / "report.md").read_text()
    )


def test_the_config_of_an_auto_run_repeats_its_choice(auto_run):
    out, metrics = auto_run
    ran = metrics["ran"]
    text = (out / "config.toml").read_text()
    assert f"schedule = 'auto' chose {ran['auto']['choice']}" in text
    options = read_toml(TrainConfig, out / "config.toml")
    cfg = dataclasses.replace(TrainConfig(), **options)
    assert cfg.schedule == ran["schedule"] and cfg.two_bp == ran["two_bp"]
    assert cfg.partition == ",".join(map(str, ran["partition"]))
    check_config(dataclasses.replace(cfg, out=str(out.parent / "again")), 4)


def test_the_report_says_how_each_stage_ran_its_compiled_blocks():
    """--compile: each stage's way as its first steps chose it, over every rank that runs it
    (data-parallel copies choose each on their own steps)."""
    from twobp.train.loop import RankResult
    from twobp.train.report import _compile_choice, _compile_lines

    results = [RankResult(rank=r) for r in range(4)]
    for result, choice in zip(
        results,
        [{0: "compiled"}, {1: "eager"}, {0: "compiled"}, {1: "compiled"}],
        strict=True,
    ):
        result.compile_choice = choice
    merged = _compile_choice(results)
    assert merged == {0: "compiled", 1: "compiled/eager"}
    assert _compile_lines(merged) == [
        "- compiled blocks, kept per stage where its first 12 steps ran faster: "
        "stage 0 compiled, stage 1 compiled/eager"
    ]
    results[0].compile_choice = {0: None}
    assert _compile_choice(results)[0] == "compiled/not chosen yet"
    assert _compile_lines(_compile_choice([RankResult(rank=0)])) == []


@pytest.mark.parametrize("policy", ["off", "paper"])
def test_a_choice_of_auto_is_repeated_by_options_the_command_line_takes(policy, tmp_path):
    # A zero-bubble schedule that keeps its own W placement is chosen with policy "off",
    # which no --policy names: the config repeats the rest, and it loads.
    from twobp.config import to_toml
    from twobp.train.what_ran import chosen_options

    ran = {
        "schedule": "zb-h1",
        "two_bp": True,
        "policy": policy,
        "partition": [5, 5],
        "stages_per_rank": 1,
        "weight_group_size": None,
    }
    options = {k: v for k, v in chosen_options(ran).items() if v is not None}
    assert options.get("policy") == (None if policy == "off" else policy)
    (tmp_path / "config.toml").write_text(to_toml(options))
    cfg = dataclasses.replace(TrainConfig(), **read_toml(TrainConfig, tmp_path / "config.toml"))
    assert (
        cfg.schedule == "zb-h1"
        and cfg.two_bp is True
        and cfg.policy == policy.replace("off", "paper")
    )
