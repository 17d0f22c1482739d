"""`twobp train` stopped early: Ctrl-C, SIGTERM, SIGHUP, a second Ctrl-C, a killed rank.

The first stop signal ends the run on every rank after the same step, with a
checkpoint of that step, the report, and the command that continues it (exit
code 130); a second one ends it at once. Real ranks and real signals: a run
in a session of its own gets SIGINT (or SIGHUP) on its whole process group, as
from a terminal, and step hooks (tests/stopping_workers.py) signal one rank or
the launcher alone. A console that is gone by then (a pipe without a reader, a
terminal that hung up) costs nothing: the command's lines go to OUT/train.log.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import pty
import re
import shlex
import signal
import struct
import subprocess
import sys
import termios
import types
from pathlib import Path

import pytest

import stopping_workers
import twobp.train.run
import twobp.train.stopping
from reliability_train_script import kill_once
from twobp.cli.main import build_parser, main
from twobp.cli.train import resume_command, train_config
from twobp.runtime.state.checkpoint import read_manifest
from twobp.train.config import TrainConfig
from twobp.train.console import RUN_LOG, Console
from twobp.train.failures import ERROR_LOG
from twobp.train.preflight import check_config
from twobp.train.stopping import SAME_REQUEST_SECONDS, StopSignals

OPTIONS = [
    "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--threads", "1",
    "--timeout", "30",
]  # fmt: skip
INTERRUPTED = 130


def _steps_in(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _with_hook(monkeypatch, hook, stop_at: int) -> None:
    monkeypatch.setenv("STOP_AT", str(stop_at))
    monkeypatch.setenv("LAUNCHER_PID", str(os.getpid()))
    hooked = functools.partial(twobp.train.run.run_training, on_step=hook)
    monkeypatch.setattr(twobp.train.run, "run_training", hooked)


def _continues(command: str, out: Path, step: int) -> None:
    """``command`` is ``twobp train`` with the run's options and ``--resume OUT``, and may run."""
    words = shlex.split(command)
    assert words[:2] == ["twobp", "train"] and words[-2:] == ["--resume", str(out)]
    cfg, _ = train_config(build_parser().parse_args(words[1:]))
    saved = read_manifest(out)
    assert saved["step"] == step
    assert {**saved["meta"]["config"], "resume": str(out)} == vars(cfg) | {"resume": str(out)}
    check_config(cfg)  # the checkpoint fits, and --out holds only this run's


def test_ctrl_c_finishes_the_step_saves_and_prints_the_resume_command(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "twobp.cli.main", "train", *OPTIONS, "--steps", "5000",
        "--log-every", "1", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert run.stderr is not None
    for line in run.stderr:
        if line.startswith("step "):  # the first step is done: the ranks are training
            break
    os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group
    printed, err = run.communicate(timeout=120)
    assert run.returncode == INTERRUPTED, err
    assert "stopping after the step in flight, then saving a checkpoint" in err
    assert "Traceback" not in err
    steps = json.loads((out / "metrics.json").read_text())["steps_run"]
    assert 1 <= steps < 5000 and _steps_in(out) == [f"step-{steps:08d}"]
    assert f"stopping after step {steps}, as asked; saving a checkpoint" in err
    lines = printed.splitlines()
    assert lines[-2] == (
        f"interrupted after step {steps} of 5000, saved in {out}/checkpoints/step-{steps:08d}"
    )
    assert lines[-1].startswith("continue with: twobp train ")
    _continues(lines[-1].removeprefix("continue with: "), out, steps)


def _a_long_run(out: Path) -> list[str]:
    return [
        sys.executable, "-m", "twobp.cli.main", "train", *OPTIONS, "--steps", "5000",
        "--log-every", "1", "--out", str(out),
    ]  # fmt: skip


def _what_the_ranks_said(out: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(out.glob("**/*.log")))


def _saved_reported_and_logged(out: Path) -> None:
    """A stopped 5000-step run saved its step, wrote its report, and logged how to continue."""
    steps = json.loads((out / "metrics.json").read_text())["steps_run"]
    assert 1 <= steps < 5000 and _steps_in(out) == [f"step-{steps:08d}"]
    assert (out / "report.md").exists()
    log = (out / RUN_LOG).read_text().splitlines()
    assert f"stopping after step {steps}, as asked; saving a checkpoint" in log
    assert log[-2] == (
        f"interrupted after step {steps} of 5000, saved in {out}/checkpoints/step-{steps:08d}"
    )
    _continues(log[-1].removeprefix("continue with: "), out, steps)


def test_ctrl_c_into_a_pipe_without_a_reader_still_saves_and_logs_the_resume_command(tmp_path):
    """`twobp train ... 2>&1 | tee LOG`, then Ctrl-C: the tee ends at once, and every later
    write of the run, rank 0's progress and the command's closing lines alike, meets a pipe
    without a reader (BrokenPipeError)."""
    out = tmp_path / "run"
    reader, writer = os.pipe()
    run = subprocess.Popen(_a_long_run(out), stdout=writer, stderr=writer, start_new_session=True)
    os.close(writer)
    with open(reader) as pipe:
        for line in pipe:
            if line.startswith("step "):  # the first step is done: the ranks are training
                break
    # The reader is gone; the next step's progress line (--log-every 1) is the first to fail.
    os.killpg(run.pid, signal.SIGINT)
    assert run.wait(timeout=120) == INTERRUPTED, _what_the_ranks_said(out)
    _saved_reported_and_logged(out)


def test_a_terminal_that_hangs_up_stops_the_run_with_a_checkpoint(tmp_path):
    """The terminal closes: SIGHUP to its whole process group (the launcher, its fork server,
    the ranks), and every later write to it fails (EIO)."""
    out = tmp_path / "run"
    terminal, tty = pty.openpty()
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # room for the bar
    run = subprocess.Popen(_a_long_run(out), stdout=tty, stderr=tty, start_new_session=True)
    os.close(tty)
    shown = b""
    while not re.search(rb"\| *[1-9][0-9]*/5000 ", shown):  # the bar after the first step
        shown += os.read(terminal, 4096)
    os.close(terminal)
    os.killpg(run.pid, signal.SIGHUP)
    assert run.wait(timeout=120) == INTERRUPTED, _what_the_ranks_said(out)
    _saved_reported_and_logged(out)


def test_a_console_whose_reader_is_gone_goes_quiet_and_stdout_s_lines_go_to_stderr(tmp_path):
    terminal, tty = pty.openpty()
    os.close(terminal)  # a terminal that hung up: every write fails (EIO)
    reader, writer = os.pipe()
    with open(tty, "w") as gone, open(reader) as seen:
        with open(writer, "w") as err:
            console = Console(tmp_path, stdout=gone, stderr=err)
            console.say("continue with: twobp train --resume runs/x")
        assert console.stdout.gone
        assert seen.read() == "continue with: twobp train --resume runs/x\n"
        # The descriptor now leads to /dev/null: the process's other writes there go quietly.
        gone.write("more\n")
        gone.flush()
    assert (tmp_path / RUN_LOG).read_text() == "continue with: twobp train --resume runs/x\n"


def test_ranks_stop_after_the_same_step_when_one_rank_is_signalled(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _with_hook(monkeypatch, stopping_workers.interrupt_this_rank, stop_at=2)
    assert main(["train", *OPTIONS, "--steps", "10", "--out", str(out)]) == INTERRUPTED
    # Rank 1 asked before step 2 (the third); both ranks saved after it, together.
    assert _steps_in(out) == ["step-00000003"]
    assert json.loads((out / "metrics.json").read_text())["steps_run"] == 3
    # The step it stopped at has its record, though no record was due there.
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-1] == 3
    printed = capsys.readouterr().out
    assert f"interrupted after step 3 of 10, saved in {out}/checkpoints/step-00000003" in printed
    _continues(printed.splitlines()[-1].removeprefix("continue with: "), out, 3)


def test_sigterm_to_the_launcher_reaches_the_ranks(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _with_hook(monkeypatch, stopping_workers.terminate_the_launcher, stop_at=2)
    args = ["train", *OPTIONS, "--steps", "10", "--no-async-save", "--out", str(out)]
    assert main(args) == INTERRUPTED
    assert _steps_in(out) == ["step-00000003"]
    assert "stopping after the step in flight" in capsys.readouterr().err
    # The step SIGTERM stopped at has its metrics.jsonl record (--log-every 10 had none due).
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3]


def test_a_second_ctrl_c_stops_at_once(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    # The step in flight hangs for a minute: only a stop at once ends the run without a
    # checkpoint. The second Ctrl-C follows the first as soon as the launcher passed the
    # first on; no time makes it one request (that window: the test below).
    monkeypatch.setattr(twobp.train.stopping, "SAME_REQUEST_SECONDS", 0.0)
    _with_hook(monkeypatch, stopping_workers.interrupt_the_launcher_twice, stop_at=2)
    assert main(["train", *OPTIONS, "--steps", "10", "--out", str(out)]) == INTERRUPTED
    assert not (out / "checkpoints").exists()
    # The launcher ended the ranks: none failed (as rank 0 would, on its 30 s timeout, had
    # the second Ctrl-C left the run waiting on the hung rank 1).
    assert not (out / ERROR_LOG).exists(), (out / ERROR_LOG).read_text()
    err = capsys.readouterr().err
    assert "stopping after the step in flight" in err and "interrupted" in err
    assert "continue with" not in err  # there is no checkpoint to continue from


def test_a_killed_rank_s_summary_prints_the_resume_command(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("KILL_AT", "4")  # rank 1 is killed before step 4, after its checkpoint
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(
        twobp.train.run,
        "run_training",
        functools.partial(twobp.train.run.run_training, on_step=kill_once),
    )
    args = [*OPTIONS, "--steps", "6", "--save-every", "2", "--no-async-save", "--out", str(out)]
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert "rank 1: killed by SIGKILL" in err
    hint = err.splitlines()[-1]
    assert hint.startswith(
        f"the latest checkpoint is {out}/checkpoints/step-00000004 (step 4); continue with: "
        "twobp train "
    )
    _continues(hint.split("continue with: ")[1], out, 4)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"steps": 50, "two_bp": False, "lr": 1e-3, "out": "runs/x y", "stop_after": 20},
        {"recompute": "all", "threads": 1, "async_save": False, "overwrite": True},
    ],
)
def test_the_resume_command_repeats_every_option(options):
    cfg = TrainConfig(**options)
    words = shlex.split(resume_command(cfg))
    again, _ = train_config(build_parser().parse_args(words[1:]))
    assert vars(again) == {**vars(cfg), "resume": cfg.out, "overwrite": False}


def test_a_signal_delivered_twice_is_one_request_and_a_later_one_stops_at_once(monkeypatch):
    # The handler reads a clock that only the test moves; os.kill runs this process's
    # handler before it returns.
    now = [100.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(twobp.train.stopping, "time", clock)
    called = []
    before = signal.getsignal(signal.SIGINT)
    with StopSignals([signal.SIGINT], on_first=called.append) as stop:
        # Ctrl-C under a launcher that forwards it: the terminal's and the launcher's copy.
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and called == [signal.SIGINT]
        now[0] += SAME_REQUEST_SECONDS * 0.99
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pytest.fail("the second copy of one signal stopped at once")
        assert called == [signal.SIGINT]
        now[0] = 100.0 + SAME_REQUEST_SECONDS
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
