"""What freeing the gathered weights before W saves, measured against the simulator.

2 x 2 gloo ranks (2 copies of a 2-rank pipeline), float64, ``shard_parameters=True``
with 2BP and ``recompute="activations"`` (a stage keeps its inputs until I and its
stash until W). Each schedule runs one step freeing each stage's gathered weights
after its last I (as twobp does) and one keeping them through its last W. Measured
from the flat buffers each rank holds after every compute action (with the
activations and stashes the memory meter holds then), the difference of the two peaks
must equal, within 10%, the difference that ``peak_memory`` predicts for the same
schedule from the profiled blocks (``CostModel.gathered_bytes`` and
``free_before_w``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from runtime_models import build_blocks, make_batch
from sharded_parameters_workers import N_MB, freed_peaks
from twobp.partition.profiler import profile_blocks
from twobp.partition.solver import uniform
from twobp.runtime import launch
from twobp.schedule import Schedule
from twobp.sim.from_profile import stage_cost_model
from twobp.sim.memory import peak_memory
from twobp.sim.recompute import with_recompute
from twobp.sim.simulate import simulate

SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b"]
ROWS = 64  # a copy's rows a step: a micro-batch's stash outweighs its stage's weights
pytestmark = pytest.mark.usefixtures("torch_one_thread")


def predicted(schedule: Schedule) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each rank's simulated peak of activations, stashes and gathered weights, freed
    before W and after W, from the blocks profiled on one micro-batch."""
    blocks = build_blocks("mlp")
    example, _ = make_batch("mlp", 0, ROWS // N_MB)
    profiled = profile_blocks(blocks, example, repeats=1, warmup=0)
    costs = stage_cost_model(profiled, uniform(len(blocks), schedule.n_stages))
    zeros = (0.0,) * costs.n_stages
    costs = replace(
        with_recompute(costs, "activations"),
        parameter_bytes=zeros,
        optimizer_bytes=zeros,
        gathered_bytes=costs.parameter_bytes,
    )
    spans = list(simulate(schedule, costs).spans)
    before = peak_memory(spans, costs, schedule.placement)
    after = peak_memory(spans, replace(costs, free_before_w=False), schedule.placement)
    return before, after


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(freed_peaks, 4, SCHEDULES, ROWS, timeout=300)


@pytest.mark.parametrize("name", SCHEDULES)
def test_freeing_before_w_saves_what_the_simulator_predicts(
    results: list[dict[str, Any]], name: str
) -> None:
    schedule = results[0][name]["schedule"]
    sim_before, sim_after = predicted(schedule)
    saved = []
    for rank, r in enumerate(results):
        runs = r[name]["runs"]
        measured_before = runs[True][0]  # freed before W, as run
        measured_after = runs[False][1]  # kept through W, as run
        # Each run also counts the other way from the same step: equal to the other run.
        assert runs[True][1] == measured_after and runs[False][0] == measured_before, (
            name,
            rank,
            runs,
        )
        pp_rank = rank % 2
        want = sim_after[pp_rank] - sim_before[pp_rank]
        got = measured_after - measured_before
        assert got >= 0 and abs(got - want) <= 0.1 * max(got, want), (name, rank, got, want)
        saved.append(got)
    if name != "zb-h1":
        # 1f1b and interleaved-1f1b run W after their last I: freeing before W saves there.
        assert any(saved), (name, saved)
    else:
        # zb-h1 runs W in its steady state: as many stashes held there, weights and all.
        assert not any(saved), (name, saved)
