"""``schedule="auto"`` over a range of tensor-parallel sizes: the size the simulation puts
fastest runs, on every rank, equal to one process (float64, gloo)."""

from __future__ import annotations

import pytest

from tensor_auto_workers import chosen_and_parity, refusal
from twobp.runtime.launch import launch

TOLERANCE = 1e-10


def _agreed(results: list[dict]) -> dict:
    first = results[0]
    for r in results:
        for key in ("tp_size", "plan_size", "steps", "schedule", "partition"):
            assert r[key] == first[key], (key, results)
        assert r["loss"] < TOLERANCE and r["parameters"] < TOLERANCE, r
    assert first["tp_size"] == first["plan_size"]
    assert [r["tp_rank"] for r in results] == [i % first["tp_size"] for i in range(len(results))]
    return first


@pytest.mark.parametrize(("link", "expected"), [("fast", 2), ("slow", 1)])
def test_the_size_the_simulation_puts_fastest_runs_on_every_rank(link, expected):
    result = _agreed(launch(chosen_and_parity, 4, link, timeout=300))
    steps = result["steps"]
    assert set(steps) == {1, 2} and None not in steps.values()
    assert min(steps, key=steps.get) == expected == result["tp_size"]
    assert result["pipeline_ranks"] == 4 // expected
    assert f"tensor_parallel={expected}" in result["summary"]


def test_a_range_that_no_size_of_can_run_is_refused_on_every_rank():
    # 3 does not divide 4 ranks; 4 heads... 2 heads do not divide by 4.
    messages = launch(refusal, 4, (3,), timeout=120)
    assert all("no size can run: T=3: does not divide the 4 ranks" in m for m in messages)
    messages = launch(refusal, 4, (4,), 2, timeout=120)
    assert all("heads" in m and "T=4" in m for m in messages), messages
