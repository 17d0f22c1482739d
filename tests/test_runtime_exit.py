"""A rank that finished its work exits cleanly, every time.

A gloo group's worker threads drop each finished operation, and with it
tensors that Python knows, which takes the interpreter lock. If the group is
still alive when the interpreter shuts down, such a thread finds it gone and
the process aborts after its work is done ("terminate called without an
active exception", SIGABRT). The group must therefore stop when it is
destroyed: nothing of a pipeline may keep it alive.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from exit_workers import (
    closed_pipeline,
    group_threads_after_destroy,
    one_step,
    steps_after_mistakes,
)
from twobp.runtime import launch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="counts threads through /proc"
)


@pytest.mark.parametrize("keep_pipeline", [False, True], ids=["dropped", "kept"])
def test_a_destroyed_group_stops_its_threads_at_once(keep_pipeline):
    results = launch(group_threads_after_destroy, 2, keep_pipeline, threads_per_rank=1, timeout=120)
    for rank, result in enumerate(results):
        assert result["during"] > result["before"], result
        assert result["after"] == result["before"], f"rank {rank}: {result}"
        if keep_pipeline:
            assert "the process group of this pipeline was destroyed" in result["error"]
            assert "build a new Pipeline" in result["error"]


def test_a_closed_pipeline_says_so_on_every_call():
    results = launch(closed_pipeline, 2, threads_per_rank=1, timeout=120)
    for rank, said in enumerate(results):
        assert set(said) == {"step", "eval_step", "timeline", "save", "clip_grad_norm_"}
        for text in said.values():
            assert text == f"rank {rank}: this pipeline was closed; build a new Pipeline to go on"


@pytest.mark.timeout(900)  # 20 process starts: about 100 s on 2 idle cores
def test_twenty_launches_in_a_row_end_cleanly():
    # Before the group stopped on destroy, about 1 launch in 5 lost a rank to SIGABRT:
    # 20 launches would have caught it with a chance of 1 - 0.8**20 = 0.99.
    for attempt in range(20):
        assert launch(one_step, 2, timeout=120) == [1, 1], f"launch {attempt}"


def test_launches_with_caught_mistakes_and_several_pipelines_end_cleanly():
    for attempt in range(5):
        assert launch(steps_after_mistakes, 2, timeout=120) == [1, 1], f"launch {attempt}"


def test_the_example_script_ends_cleanly_every_time():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for attempt in range(3):
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "train_mlp.py")],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, f"run {attempt}:\n{done.stdout}\n{done.stderr}"
        assert "terminate called" not in done.stderr
        assert "final loss on each rank" in done.stdout
