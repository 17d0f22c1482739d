"""A V without an example input balances its stages on its first step, on 2 gloo ranks."""

from __future__ import annotations

import pytest

from twobp.partition import solve
from twobp.partition.profiler import solver_costs
from twobp.runtime import launch
from v_balance_workers import balanced_at_first_step, failed_while_balancing, reference

STEPS = 2
TOL = 1e-10
UNIFORM = [3, 3, 2, 2]  # 10 blocks on the 4 stages of a V on 2 ranks
V_RANKS = [0, 1, 1, 0]  # the rank of each stage


def _rank_loads(sizes: list[int], costs: list[float]) -> list[float]:
    loads = [0.0, 0.0]
    start = 0
    for stage, size in enumerate(sizes):
        loads[V_RANKS[stage]] += sum(costs[start : start + size])
        start += size
    return loads


@pytest.fixture(scope="module", params=["zb-v", "dualpipev"])
def ran(request) -> tuple[str, list[dict]]:
    schedule = request.param
    return schedule, launch(
        balanced_at_first_step, 2, schedule, STEPS, threads_per_rank=1, timeout=120
    )


def test_every_rank_runs_the_partition_rank_0_balanced_on_the_first_micro_batch(ran):
    _, (first, second) = ran
    assert first["sizes"] == second["sizes"]
    assert first["before"] is None  # not planned until the first step
    assert first["by"].startswith("balanced on the first step's first micro-batch")
    assert first["by"] == second["by"]
    (costs,) = first["costs"]  # rank 0 profiled once; rank 1 not at all
    assert second["costs"] == []
    assert first["sizes"] == solve(solver_costs(costs), 4).sizes


def test_the_heavy_ends_get_a_rank_no_busier_than_uniform_would_leave_it(ran):
    _, (first, _) = ran
    (costs,) = first["costs"]
    per_block = solver_costs(costs)
    chosen = _rank_loads(first["sizes"], per_block)
    uniform = _rank_loads(UNIFORM, per_block)
    assert max(chosen) < 0.9 * max(uniform), (first["sizes"], chosen, uniform)
    # The ends, on rank 0, hold fewer of the layers between them than uniform gives them.
    assert first["sizes"][0] + first["sizes"][-1] < UNIFORM[0] + UNIFORM[-1]


def test_the_balanced_v_trains_as_one_process(ran):
    _, results = ran
    expected = reference(STEPS)
    for result in results:
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOL, rel=0)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert set(grads) == set(expected["grads"])
    for name, want in expected["grads"].items():
        assert (grads[name] - want).abs().max().item() < TOL, name


def test_a_block_that_fails_while_rank_0_balances_fails_the_step_on_every_rank():
    results = launch(failed_while_balancing, 2, threads_per_rank=1, timeout=120)
    assert results[0]["failed"] == ("RuntimeError", "block failed on purpose")
    name, message = results[1]["failed"]
    assert name == "PipelineConfigError", results[1]["failed"]
    assert message.startswith("rank 1: rank 0 failed to profile the blocks"), message
    assert "RuntimeError: block failed on purpose" in message
    # Nothing was planned: the next step plans, balances and trains as one process.
    expected = reference(1)
    for result in results:
        assert result["by"].startswith("balanced on the first step's first micro-batch")
        assert result["loss"] == pytest.approx(expected["losses"][0], abs=TOL, rel=0)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert set(grads) == set(expected["grads"])
    for name, want in expected["grads"].items():
        assert (grads[name] - want).abs().max().item() < TOL, name
