"""`twobp train` tells of skipped steps as they happen, counts them at the end, and fails a
run that skipped them all.

A float16 overflow (the loss scaler) or, with --nonfinite skip, a loss that is
not finite skips a step on every rank. Real runs of the command on 2 ranks:
the console gets a warning at the first step skipped for a reason, then one
line every --log-every steps skipped for it; the closing line counts them, and
a run that updated no weight exits 1 naming the loss scale.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from twobp.train.skipped import SkipNotes, every_step_skipped, skipped_text

SMALL = [
    "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--threads", "1",
    "--timeout", "60", "--no-save",
]  # fmt: skip


def _train(out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "twobp.cli.main", "train", *SMALL, *options, "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _skip_lines(err: str) -> list[str]:
    """The lines of the ranks about skipped steps (the command's own error left out)."""
    return [
        line
        for line in err.splitlines()
        if "skipped" in line and not line.startswith("twobp train:")
    ]


def _done_line(printed: str) -> str:
    return next(line for line in printed.splitlines() if line.startswith("done: "))


def test_a_run_whose_every_step_overflows_says_so_as_it_goes_and_fails(tmp_path):
    out = tmp_path / "run"
    run = _train(
        out, "--steps", "7", "--log-every", "3", "--dtype", "float16", "--autocast",
        "--loss-scale", "1e12",
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert _skip_lines(run.stderr) == [
        "warning: step 1/7 skipped: the gradients overflowed float16 at loss scale 1e+12 "
        "(static); no weight was updated",
        "step 3/7: 3 steps skipped so far (float16 overflow)",
        "step 6/7: 6 steps skipped so far (float16 overflow)",
    ]
    assert _done_line(run.stdout).endswith("; 7 of 7 steps skipped (float16 overflow)")
    error = run.stderr.splitlines()[-1]
    assert error.startswith(
        "twobp train: all 7 steps of the run were skipped (float16 overflow), no weight was "
        "updated; the gradients overflowed float16 at the static loss scale 1e+12: give a "
        "smaller --loss-scale"
    )
    assert "--loss-scale dynamic" in error
    assert (out / "report.md").exists()
    assert error in (out / "train.log").read_text()


def test_steps_skipped_for_a_nonfinite_loss_are_told_and_counted(tmp_path):
    out = tmp_path / "run"
    # The first update, at a learning rate of 1e30, breaks the weights: later losses are NaN.
    run = _train(
        out, "--steps", "4", "--log-every", "2", "--lr", "1e30", "--warmup", "1",
        "--nonfinite", "skip",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    skipped = json.loads((out / "metrics.json").read_text())["skipped_steps"]
    assert 2 <= len(skipped) < 4
    first = skipped[0] + 1
    assert _skip_lines(run.stderr) == [
        f"warning: step {first}/4 skipped: the loss is nan (--nonfinite skip); its gradients "
        "were dropped",
        f"step {skipped[1] + 1}/4: 2 steps skipped so far (non-finite loss)",
    ]
    done = _done_line(run.stdout)
    assert done.endswith(f"; {len(skipped)} of 4 steps skipped (non-finite loss)")


def test_a_run_without_skipped_steps_says_nothing_of_them(tmp_path):
    summary = _summary(steps=3)
    assert skipped_text(summary) is None and every_step_skipped(summary) is None
    notes = SkipNotes(total=100, every=10)
    lines = [notes.nonfinite(step, float("inf")) for step in range(1, 31)]
    assert [i + 1 for i, line in enumerate(lines) if line] == [1, 10, 20, 30]


def _summary(steps: int, **fields: object) -> dict[str, object]:
    return {
        "steps_this_run": steps,
        "resumed_from_step": None,
        "overflow_steps": [],
        "skipped_steps": [],
        "loss_scale": None,
        "loss_scale_state": None,
        **fields,
    }


def test_every_step_skipped_names_the_dynamic_scale_and_counts_the_run_s_own_steps():
    dynamic = _summary(
        3, overflow_steps=[0, 1, 2], loss_scale="dynamic", loss_scale_state={"scale": 8192.0}
    )
    assert skipped_text(dynamic) == "3 of 3 steps skipped (float16 overflow)"
    error = every_step_skipped(dynamic)
    assert error is not None and "every dynamic loss scale, down to 8192: run more" in error
    # Resumed at step 10: step 3 was skipped in the run it continued.
    resumed = _summary(
        2, resumed_from_step=10, skipped_steps=[3, 10], overflow_steps=[11],
        loss_scale="static", loss_scale_state={"scale": 1e6},
    )  # fmt: skip
    assert skipped_text(resumed) == "2 of 2 steps skipped (1 float16 overflow, 1 non-finite loss)"
    error = every_step_skipped(resumed)
    assert error is not None and error.startswith(
        "all 2 steps of the run were skipped (1 float16 overflow, 1 non-finite loss)"
    )
    assert "static loss scale 1e+06" in error and "a lower --lr" in error
    assert every_step_skipped({**resumed, "steps_this_run": 3}) is None
