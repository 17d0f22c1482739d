"""How launch() starts its ranks: a fork server, or a spawned interpreter per rank."""

from __future__ import annotations

import pytest

from launch_workers import modules_at_start, say_and_read
from twobp.runtime.launch import launch

NAME = "TWOBP_TEST_LAUNCH_VARIABLE"


def test_forked_ranks_get_the_callers_environment_and_output_as_they_are_at_the_call(
    monkeypatch, capfd
):
    # The first launch starts the fork server (in this process, once): what changes after
    # it, the environment and where the output goes (capfd: a file of this test), must
    # still reach the ranks of the next launches. (Spawned ranks inherit both anyway.)
    start_method = "forkserver"
    monkeypatch.setenv(NAME, "first")
    with capfd.disabled():  # the server's output is not this test's
        first = launch(say_and_read, 2, NAME, start_method=start_method, timeout=120)
    assert first == ["first"] * 2
    monkeypatch.setenv(NAME, "second")
    assert launch(say_and_read, 2, NAME, start_method=start_method, timeout=120) == ["second"] * 2
    monkeypatch.delenv(NAME)
    assert launch(say_and_read, 2, NAME, start_method=start_method, timeout=120) == [None] * 2
    captured = capfd.readouterr()
    for rank in range(2):
        # (A rank may write the line and its end apart, between another rank's writes.)
        assert captured.out.count(f"out of rank {rank}") == 2
        assert captured.err.count(f"err of rank {rank}") == 2


def test_an_unknown_start_method_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="start_method must be one of forkserver, spawn"):
        launch(say_and_read, 2, NAME, start_method="fork")


def test_forked_ranks_start_with_what_every_pipeline_rank_imports():
    # torch imports torch._dynamo on a process's first optimizer (and torch.compile needs
    # it): about a second per rank, unless the fork server imported it first.
    names = ["torch", "torch.distributed", "torch._dynamo", "twobp"]
    at_start = launch(modules_at_start, 2, names, start_method="forkserver", timeout=120)
    assert at_start == [[True] * len(names)] * 2
