"""The replay of benchmarks/pipeline_overhead/critical_path.py: 1F1B-1's step from its
actions' times, with free transfers, worked out by hand."""

from __future__ import annotations

import pytest

from repo_scripts import load_script

critical_path = load_script("benchmarks/pipeline_overhead/critical_path.py")

FUSED = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
SPLIT = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1I0", "1F1", "1I1", "1W0-1"]}


def test_the_replay_walks_the_critical_path_of_each_list():
    times = {"0:F:1": [1.0], "0:B:1": [2.0], "1:F:1": [0.5, 1.5], "1:B:1": [2.0], "1:I:1": [1.0]}
    times["1:W:2"] = [1.0]  # the mean of each action's times
    # F0 (rank 0), F0 B0 F1 B1 (rank 1), B1 (rank 0)
    assert critical_path.replay(FUSED, times) == pytest.approx(9.0)
    # F0 (rank 0), F0 I0 F1 I1 (rank 1), B1 (rank 0); rank 1's W ends at 6
    assert critical_path.replay(SPLIT, times) == pytest.approx(7.0)
    # a W of both micro-batches longer than rank 0's last B sets the step
    assert critical_path.replay(SPLIT, {**times, "1:W:2": [4.0]}) == pytest.approx(9.0)
