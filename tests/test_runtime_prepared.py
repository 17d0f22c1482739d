"""What ``schedule="auto"`` simulated for its choice is what the pipeline runs.

One preparation pass (:mod:`twobp.schedule.prepare`) builds the schedule of
the runtime and of the search: on real gloo ranks, for a plain, a replicated
(data parallel) and a tied pipeline, the lowered schedule a pipeline runs
equals, action for action, the one the simulator timed for the chosen
option, first-stage fusion and reductions included; a pipeline given the
chosen options by name runs the same; and ``twobp plan`` on the same cost
model names the same choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prepared_workers import auto_and_simulated
from twobp.cli.main import main
from twobp.runtime import launch
from twobp.sim import CostModel
from twobp.sim.cost_io import save_costs

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# The head stage costs more: 2BP pays, and W of the other stages has a bubble to fill.
COSTS = CostModel(
    forward=(1.0, 2.0),
    backward_input=(1.0, 2.0),
    backward_weight=(1.0, 2.0),
    backward_full=(2.0, 4.0),
    activation_bytes=(100.0, 100.0),
    weight_grad_bytes=(100.0, 100.0),
    parameter_bytes=(1000.0, 1000.0),
)


def _two() -> list[dict[str, Any]]:
    # One stage per rank: the tied embedding and head are on two ranks.
    return [auto_and_simulated("mlp", COSTS, 1), auto_and_simulated("tied", COSTS, 1, 1)]


def _four() -> list[dict[str, Any]]:
    return [auto_and_simulated("mlp", COSTS, 2)]


def _check(results: list[Any], case: int, reductions: bool) -> None:
    for rank, by_case in enumerate(results):
        r = by_case[case]
        assert r["runs"] == r["simulated"], f"rank {rank} runs another schedule than simulated"
        assert r.get("fixed", r["runs"]) == r["runs"], f"rank {rank}: the named options differ"
        assert (r["reductions"] > 0) == reductions, r["reductions"]
        assert r["fused_first_stage"] or not r["split"], "a split schedule keeps stage 0's I, W"


@pytest.fixture(scope="module")
def two() -> list[Any]:
    return launch(_two, 2, threads_per_rank=1, timeout=300)


def test_auto_runs_the_schedule_it_simulated_plain_and_tied(two: list[Any]) -> None:
    _check(two, 0, reductions=False)
    _check(two, 1, reductions=True)


def test_twobp_plan_says_what_auto_runs_on_the_same_costs(
    two: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "costs.json"
    save_costs(COSTS, path)
    assert main(["plan", "--stages", "2", "--microbatches", "4", "--costs-file", str(path)]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    chosen = two[0][0]["described"]
    assert said.startswith(f"schedule='auto' on these costs would run {chosen} ("), said


def test_auto_runs_the_schedule_it_simulated_with_data_parallel() -> None:
    _check(launch(_four, 4, threads_per_rank=1, timeout=300), 0, reductions=True)
