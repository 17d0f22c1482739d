"""The command line answers a mistake in one line, and a failed rank in a short summary.

A mistake in the options of any sub-command is one line on stderr,
``twobp <sub>: error: ...`` naming the option, with exit code 2, and no rank
starts. A rank that fails during ``twobp train`` gives one line per failed
rank, exit code 1, and its traceback in ``OUT/errors.log``, not on the terminal
(unless ``--verbose``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import twobp
from twobp.cli.main import main
from twobp.runtime.errors import LaunchError, RankFailure
from twobp.train.failures import failure_summary

# (sub-command, arguments, what the line must name); {tmp} is a fresh folder.
MISTAKES = [
    ("train", ["--schedule", "foo"], "--schedule foo: unknown schedule 'foo'"),
    ("train", ["--schedule", "{tmp}/none.csv"], "none.csv' does not exist"),
    ("train", ["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
    ("train", ["--policy", "lazy"], "argument --policy: invalid choice: 'lazy'"),
    ("train", ["--partition", "1,2,3"], "--partition 1,2,3"),
    ("train", ["--ranks", "8"], "the model has 6 blocks but the schedule has 8 stages"),
    ("train", ["--batch-size", "3"], "--batch-size 3 holds fewer samples than 4 micro-batches"),
    ("train", ["--seq-len", "64:32"], "'64:32': give a length N or a range LO:HI"),
    ("train", ["--min-seq-len", "80"], "--min-seq-len 80 must be from 1 to --seq-len 64"),
    ("train", ["--data", "{tmp}/none.txt"], "--data {tmp}/none.txt: no such file"),
    ("train", ["--resume", "{tmp}/none"], "--resume {tmp}/none:"),
    ("train", ["--out", "{tmp}/file"], "--out {tmp}/file: is a file, not a folder"),
    ("train", ["--size", "huge"], "--size huge: unknown size 'huge' of llama"),
    ("train", ["--steps", "0"], "--steps must be >= 1"),
    ("train", ["--data-parallel", "3", "--batch-size", "12"], "2 ranks do not form 3 copies"),
    ("train", ["--ranks", "4", "--data-parallel", "2", "--batch-size", "6"], "x --data-parallel"),
    ("train", ["--schedule", "chimera", "--microbatches", "3", "--batch-size", "6"], "even number"),
    ("train", ["--schedule", "dualpipev", "--microbatches", "2"], "at least 2p = 4 micro-batches"),
    ("train", ["--microbatches", "auto"], "--microbatches auto is chosen by --schedule auto"),
    ("train", ["--shard-parameters"], "--shard-parameters does not take --data-parallel 1"),
    ("train", ["--microbatches", "some"], "--microbatches must be a count or 'auto'"),
    ("simulate", ["--schedule", "foo"], "argument --schedule: invalid choice: 'foo'"),
    ("simulate", ["--stages", "0"], "--stages must be >= 1"),
    ("simulate", ["--schedule", "dualpipe", "--stages", "3"], "mirror each other), got 3"),
    ("simulate", ["--costs", "F=x"], "--costs F=x: cannot read 'x' as a number"),
    ("simulate", ["--costs-file", "{tmp}/none.json"], "--costs-file {tmp}/none.json"),
    ("simulate", ["--png", "{tmp}/none/a.png"], "--png {tmp}/none/a.png: the folder"),
    ("plan", ["--schedules", "1f1b,foo"], "argument --schedules: invalid choice: 'foo'"),
    ("plan", ["--memory-limit", "5XB"], "--memory-limit 5XB: cannot read '5XB'"),
    ("profile", ["--size", "huge"], "--size huge: unknown size 'huge'"),
    ("profile", ["--stages", "9"], "--stages 9: llama-tiny has 6 blocks"),
    ("bench", ["--quick", "--schedules", "nope"], "--schedules: unknown 'nope'"),
    ("bench", ["--quick", "--size", "huge"], "--size huge: unknown size 'huge'"),
    ("checkpoint", ["info", "{tmp}/none"], "{tmp}/none does not exist"),
    ("checkpoint", ["merge", "{tmp}/none", "{tmp}/merged.pt"], "{tmp}/none does not exist"),
]


@pytest.mark.parametrize(("command", "argv", "named"), MISTAKES, ids=lambda x: str(x))
def test_a_mistake_is_one_line_and_exit_2(command, argv, named, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = tmp_path / "run"
    extra = ["--out", str(out)] if command in ("train", "bench") and "--out" not in argv else []
    assert main([command, *argv, *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"twobp {command}: error: "), lines[0]
    assert named.format(tmp=tmp_path) in lines[0]
    assert captured.out == ""
    assert not out.exists()  # nothing started


def test_the_command_prints_no_traceback_for_a_mistake(tmp_path):
    # The twobp under test, wherever the test runs from.
    env = {**os.environ, "PYTHONPATH": str(Path(twobp.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "twobp.cli.main", "train", "--schedule", "foo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("twobp train: error: --schedule foo: unknown schedule")
    assert len(done.stderr.splitlines()) == 1, done.stderr


# The learning rate makes the loss NaN at the third step; every rank raises.
DIVERGING = [
    "train", "--steps", "6", "--batch-size", "4", "--microbatches", "2", "--seq-len", "16",
    "--lr", "1e30", "--warmup", "1", "--threads", "1", "--timeout", "60", "--no-save",
]  # fmt: skip


def test_a_failed_rank_is_a_short_summary_and_a_log(tmp_path, capfd):
    out = tmp_path / "run"
    assert main([*DIVERGING, "--out", str(out)]) == 1
    err = capfd.readouterr().err
    # Only the summary reaches the terminal (and rank 0's progress line).
    assert "Traceback" not in err
    summary = err[err.index("twobp train: ") :].splitlines()
    # Both ranks raise: either may be the first.
    assert summary[0].startswith("twobp train: 2 of 2 processes failed; the first was rank ")
    assert sorted(line.split(":")[0] for line in summary[1:3]) == ["  rank 0", "  rank 1"]
    assert all("NonFiniteLossError: the mean loss of step" in line for line in summary[1:3])
    assert summary[3].startswith(f"tracebacks in {out / 'errors.log'}")
    assert len(summary) == 4
    log = (out / "errors.log").read_text()
    assert log.count("Traceback (most recent call last)") == 2
    assert "Lower the learning rate" in log
    assert "Traceback" in (out / "logs" / "rank1.log").read_text()


def test_verbose_shows_the_tracebacks(tmp_path, capfd):
    out = tmp_path / "run"
    assert main([*DIVERGING, "--verbose", "--out", str(out)]) == 1
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert f"tracebacks in {out / 'errors.log'}\n" in err
    assert (out / "errors.log").exists() and not (out / "logs" / "rank0.log").exists()


def test_the_summary_has_one_short_line_per_rank():
    long = "the loss is nan (on rank 1). " + "Then a long explanation of what to do. " * 10
    failures = [
        RankFailure(1, 1, "ValueError", "bad input\nmore detail", "Traceback ..."),
        RankFailure(0, 1, "NonFiniteLossError", f"rank 0: {long}", "Traceback ..."),
        RankFailure(2, -9, message="killed by SIGKILL"),
    ]
    text = failure_summary(LaunchError(failures, 3), Path("runs/x"), verbose=False)
    assert text.splitlines() == [
        "3 of 3 processes failed; the first was rank 1",
        "  rank 1: ValueError: bad input",
        "  rank 0: NonFiniteLossError: the loss is nan (on rank 1). (more in the log)",
        "  rank 2: killed by SIGKILL",
        "tracebacks in runs/x/errors.log, each rank's output in runs/x/logs/ "
        "(--verbose prints them here)",
    ]


def test_a_launch_error_says_one_line_per_rank_and_keeps_the_tracebacks_in_details():
    """The message is the summary only (each rank printed its traceback on its own stderr,
    and `twobp train` writes them to OUT/errors.log); `details` has them all."""
    raised = 'Traceback (most recent call last):\n  File "/a/run.py", line 3, in f\n'
    stack = 'Current thread 0x1 (most recent call first):\n  File "/a/loss.py", line 9 in g\n'
    failures = [
        RankFailure(1, 1, "ValueError", "bad input", raised + "ValueError: bad input\n"),
        RankFailure(0, -15, message="terminated", stack=stack),
    ]
    error = LaunchError(failures, 2)
    assert str(error).splitlines() == [
        "2 of 2 processes failed; the first was rank 1",
        "  rank 1: ValueError: bad input",
        '  rank 0: terminated; it was at "/a/loss.py", line 9 in g',
    ]
    assert raised in error.details and stack.rstrip() in error.details


def test_a_reader_that_leaves_the_pipe_gets_no_traceback():
    # `twobp plan | head -1`: the reader is gone before the command writes.
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "twobp.cli.main", "plan", "--stages", "2"],
            stdout=write, stderr=subprocess.PIPE, text=True, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr
