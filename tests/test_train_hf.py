"""`twobp train --hf-config`: a Hugging Face model through the same job and report."""

import json

import pytest

import twobp.train.preflight
from twobp.cli.main import main

pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_hugging_face_llama_trains_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    code = main(
        [
            "train", "--hf-config", "llama", "--size", "tiny", "--steps", "3",
            "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--warmup", "1",
            "--threads", "1", "--timeout", "60", "--no-save", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 3
    # A fresh byte-level model starts near ln(256) = 5.5.
    assert 4.5 < metrics["loss_first"] < 6.5
    report = (out / "report.md").read_text()
    assert report.startswith("# twobp train: hf-llama-tiny 1f1b 2BP:paper")
    assert "(byte-level, next byte)" in report


def test_hf_config_without_transformers_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(twobp.train.preflight, "transformers_importable", lambda: False)
    code = main(["train", "--hf-config", "gpt2", "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err == (
        "twobp train: error: --hf-config needs the transformers extra "
        "(pip install twobp[transformers])\n"
    )
