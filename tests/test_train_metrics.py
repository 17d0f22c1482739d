"""`twobp train` metrics: OUT/metrics.jsonl and TensorBoard event files, and the progress display.

A real run writes one record every ``--log-every`` steps and at its last; the
TensorBoard files, read back with tensorboard's own reader, hold the same
figures. A run resumed from an earlier checkpoint into the same folder drops
the records of the steps it runs again, in both. The progress is a tqdm bar on
a terminal and plain lines elsewhere.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from twobp.cli.main import main
from twobp.runtime.state.checkpoint import read_manifest
from twobp.train.metrics import MetricsLog, StepMetrics, read_records
from twobp.train.progress import Progress
from twobp.train.what_ran import resumed_split_text

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

OPTIONS = [
    "--steps", "6", "--batch-size", "4", "--microbatches", "2", "--seq-len", "16",
    "--dtype", "float64", "--threads", "1", "--timeout", "60", "--warmup", "2",
]  # fmt: skip


def _scalars(out: Path, tag: str) -> dict[int, float]:
    reader = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    reader.Reload()
    events = reader.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step twice in {steps}"
    return {e.step: e.value for e in events}


def test_a_run_writes_jsonl_and_tensorboard_and_a_resume_continues_them(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*OPTIONS, "--log-every", "2", "--save-every", "2", "--keep-checkpoints", "3"]
    assert main(["train", *argv, "--grad-clip", "0", "--out", str(out)]) == 0
    records = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6]
    losses = json.loads((out / "metrics.json").read_text())["losses"]
    for r in records:
        assert r["loss"] == losses[r["step"] - 1]
        assert r["grad_norm"] > 0 and r["lr"] > 0 and 0 <= r["bubble"] < 1
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 16)
        assert len(r["peak_rss_bytes"]) == 2 and all(b > 0 for b in r["peak_rss_bytes"])
        assert len(r["peak_stash_bytes"]) == 2 and r["peak_device_bytes"] is None
    loss = _scalars(out, "loss/train")
    assert loss == {r["step"]: pytest.approx(r["loss"]) for r in records}
    assert _scalars(out, "optimizer/grad_norm")[6] == pytest.approx(records[-1]["grad_norm"])
    assert set(_scalars(out, "memory/peak_rss_mib/rank1")) == {2, 4, 6}
    # Resumed from step 4 into the same folder, logging every step: steps 5 and 6 run again
    # (--overwrite: the step-6 checkpoint is replaced). two_bp is unset: the resume splits
    # the stages the first run's profile chose, not a new profile's choice.
    source = out / "checkpoints" / "step-00000004"
    chosen = read_manifest(source)["meta"]["two_bp_split"]["split"]
    assert len(chosen) == 2
    resumed = ["--resume", str(source), "--log-every", "1", "--grad-clip", "0", "--overwrite"]
    resumed += ["--out", str(out)]
    assert main(["train", *OPTIONS, *resumed]) == 0
    again = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in again] == [2, 4, 5, 6]
    assert again[:2] == records[:2]
    assert again[3]["loss"] == records[2]["loss"]  # float64 on the CPU: bitwise the same
    assert _scalars(out, "loss/train") == {r["step"]: pytest.approx(r["loss"]) for r in again}
    assert resumed_split_text(chosen) in (out / "report.md").read_text()
    capsys.readouterr()


def _record(step: int, **changes: object) -> StepMetrics:
    values: dict[str, object] = dict(
        step=step, loss=1.5, lr=1e-3, grad_norm=0.5, samples_per_s=10.0, tokens_per_s=None,
        bubble=0.25, step_seconds=0.1, peak_rss_bytes=[2**20], peak_stash_bytes=[0],
        peak_device_bytes=None,
    )  # fmt: skip
    values.update(changes)
    return StepMetrics(**values)  # type: ignore[arg-type]


def test_images_and_skipped_steps_are_null_in_jsonl_and_absent_in_tensorboard(tmp_path):
    log = MetricsLog(tmp_path)
    log.write(_record(1, loss=float("nan"), grad_norm=None))
    log.write(_record(2))
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["loss"] is None and first["grad_norm"] is None and first["tokens_per_s"] is None
    assert _scalars(tmp_path, "loss/train") == {2: 1.5}
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    assert "throughput/tokens_per_s" not in reader.Tags()["scalars"]


def test_without_tensorboard_the_jsonl_file_is_still_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    log = MetricsLog(tmp_path)
    assert log.tensorboard_missing
    log.write(_record(1))
    log.close()
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1]
    assert not (tmp_path / "tensorboard").exists()


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(25, every=10, stream=stream)
    for step in range(1, 26):
        progress.update(step, 2.0, 32.0, None if step < 25 else 64.0)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "\r" not in stream.getvalue()
    assert "loss  2.0000" in lines[0] and "32.0 samples/s" in lines[0] and "eta" in lines[0]
    assert "tokens/s" not in lines[0] and "64 tokens/s" in lines[-1]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal():
    stream = _Terminal()
    progress = Progress(20, every=10, stream=stream, initial=5)
    for step in range(6, 21):
        progress.update(step, 1.25, 32.0, 2048.0)
    progress.close()
    text = stream.getvalue()
    assert "\r" in text and "20/20" in text and "step/s" in text
    assert "loss  1.2500" in text and "2048 tokens/s" in text


class _Clock:
    """Seconds that a test sets: the first step compiles for 50 s, the others take 0.1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _compiled_steps(progress: Progress, clock: _Clock, total: int) -> None:
    for step in range(1, total + 1):
        clock.now += 50.0 if step == 1 else 0.1
        progress.update(step, 2.0, 32.0, None)


def test_the_rate_and_eta_leave_out_the_warm_up_steps():
    """`--compile`'s first step takes 50 s and the next 0.1 s each: the ETA is that of the
    steps left at 10 steps/s, not of a mean step of 0.6 s; `?` until the warm-up is over."""
    stream, clock = io.StringIO(), _Clock()
    progress = Progress(100, every=10, stream=stream, warmup=2, clock=clock)
    _compiled_steps(progress, clock, 100)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("? steps/s, eta ?")  # step 1: still compiling, as far as it knows
    assert lines[1].startswith("step  10/100") and lines[1].endswith("10.00 steps/s, eta 00:09")
    assert lines[-1].endswith("10.00 steps/s, eta 00:00")


def test_a_bar_s_eta_leaves_out_the_warm_up_steps():
    stream, clock = _Terminal(), _Clock()
    progress = Progress(100, every=10, stream=stream, warmup=2, clock=clock)
    _compiled_steps(progress, clock, 10)
    # The steps after the warm-up, whatever tqdm's own clock timed (the bar as it redraws).
    assert "10/100 [" in str(progress._bar) and "<00:09, 10.00step/s" in str(progress._bar)


def test_compile_says_which_stages_it_compiles_before_the_first_step(tmp_path, monkeypatch, capfd):
    """`--compile`'s first step compiles (tens of seconds): the run says so, stage by stage,
    on the console and in OUT/train.log. (torch.compile is off here: the lines are the
    run's, not dynamo's.)"""
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    out = tmp_path / "run"
    argv = ["train", "--compile", "--steps", "1", "--batch-size", "4", "--microbatches", "2",
            "--seq-len", "16", "--threads", "1", "--no-save", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "compiling stage 0 ...\ncompiling stage 1 ...\nstep 1/1 " in err
    assert "compiling stage 1 ..." in (out / "train.log").read_text()
