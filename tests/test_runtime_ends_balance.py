"""Chimera and DualPipe on 4 ranks put the model's ends on one rank: without an example
input they balance their stages on the first step, as a V does (4 gloo ranks)."""

from __future__ import annotations

import pytest

from twobp.partition import solve
from twobp.partition.profiler import solver_costs
from twobp.runtime import launch
from twobp.schedule import generate
from v_balance_workers import balanced_at_first_step, reference

STEPS = 2
TOL = 1e-10
UNIFORM = [3, 3, 2, 2]  # 10 blocks on 4 stages


def _rank_loads(placement: tuple[int, ...], sizes: list[int], costs: list[float]) -> list[float]:
    """Each rank's share of the blocks' time: the model stages it holds in every pipeline."""
    stage_costs, start = [], 0
    for size in sizes:
        stage_costs.append(sum(costs[start : start + size]))
        start += size
    loads = [0.0] * (max(placement) + 1)
    for stage, rank in enumerate(placement):
        loads[rank] += stage_costs[stage % len(sizes)]
    return loads


@pytest.mark.parametrize(("schedule", "n_mb"), [("chimera", 4), ("dualpipe", 8)])
def test_two_pipelines_in_opposite_directions_balance_their_ends_at_the_first_step(
    schedule: str, n_mb: int
) -> None:
    placement = generate(schedule, 4, n_mb).placement
    results = launch(
        balanced_at_first_step, 4, schedule, STEPS, n_mb, threads_per_rank=1, timeout=300
    )
    first = results[0]
    assert first["before"] is None  # not planned until the first step
    assert first["by"].startswith("balanced on the first step's first micro-batch (two pipelines")
    assert all(r["sizes"] == first["sizes"] and r["by"] == first["by"] for r in results)
    (costs,) = first["costs"]  # rank 0 profiled once, the others not at all
    assert all(r["costs"] == [] for r in results[1:])
    per_block = solver_costs(costs)
    assert first["sizes"] == solve(per_block, 4).sizes
    # The ranks that hold both heavy ends hold them with fewer of the layers between them
    # than a uniform cut gives them, and are no busier than it leaves them.
    assert first["sizes"][0] + first["sizes"][-1] < UNIFORM[0] + UNIFORM[-1], first["sizes"]
    chosen = _rank_loads(placement, first["sizes"], per_block)
    uniform = _rank_loads(placement, UNIFORM, per_block)
    assert max(chosen) < max(uniform), (first["sizes"], chosen, uniform)
    expected = reference(STEPS)
    for result in results:
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOL, rel=0)
    grads: dict = {}
    for result in results:
        for name, grad in result["grads"].items():
            grads[name] = grads.get(name, 0) + grad  # each model stage is held twice
    assert set(grads) == set(expected["grads"])
    for name, want in expected["grads"].items():
        assert (grads[name] / 2 - want).abs().max().item() < TOL, name


def test_chimera_on_two_ranks_holds_every_stage_on_each_and_stays_uniform() -> None:
    assert not generate("chimera", 2, 4).ends_share_a_rank
    assert generate("chimera", 4, 4).ends_share_a_rank
    assert generate("zb-v", 2, 4).ends_share_a_rank
    assert not generate("interleaved-1f1b", 2, 4).ends_share_a_rank
    assert not generate("1f1b", 4, 4).ends_share_a_rank
