"""``schedule="auto"`` over a range of tensor-parallel sizes: the size the simulation puts
fastest runs, on every rank, equal to one process (float64, gloo)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tensor_auto_workers import chosen_and_parity, link_costs, refusal
from tensor_parallel_pipeline_workers import LLAMA
from twobp.models import build_model, tensor_parallel_plan
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.launch import launch
from twobp.runtime.options import PipelineOptions
from twobp.runtime.setup.auto.tensor_size import _candidates, _fastest, _space
from twobp.sim.tensor_parallel import Link

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


def _sized(limit: float | None):
    """Rank 0's choice over T 1 and 2 on 4 ranks under the fast link's costs, each stage
    holding 100 bytes of parameters unsplit, within ``limit`` bytes per rank."""
    blocks = list(build_model("llama", "tiny", dtype=torch.float64, **LLAMA).blocks)
    model = replace(link_costs("fast"), parameter_bytes=(100.0,))
    options = PipelineOptions(
        schedule="auto",
        n_microbatches=4,
        tensor_parallel=(1, 2),
        tensor_parallel_plan=tensor_parallel_plan("llama"),
        costs=model,
    )
    splits, tried = _candidates(blocks, options, (1, 2), 4)
    space = _space(blocks, options, model, None, 4)
    return _fastest(space, splits, tried, Link(math.inf, 0.0), (limit, 1, blocks))


def test_the_fastest_size_that_fits_the_memory_limit_runs():
    # Split stages hold a third of the weights each, unsplit ones a quarter: T 2 is the
    # fastest, but over 35 bytes per rank it is not, and under 34 nothing of it fits.
    unbounded = _sized(None)
    assert unbounded.tensor_parallel == 2
    assert unbounded.choice.peak_memory > 35
    bounded = _sized(35)
    assert bounded.tensor_parallel == 1 and bounded.choice.peak_memory <= 35
    slower = {t.size: t.step for t in bounded.tensor_sizes}
    assert slower[2] > slower[1]  # its candidates within the limit are slower
    tight = _sized(30)
    assert tight.tensor_parallel == 1
    assert "no schedule fits memory_limit=30" in tight.tensor_sizes[1].why_not


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"schedule": "auto"}, "needs tensor_parallel_plan"),
        ({"schedule": "1f1b", "tensor_parallel_plan": {}}, "searched by schedule='auto'"),
        (
            {"schedule": "auto", "tensor_parallel_plan": {}, "n_microbatches": "auto"},
            "n_microbatches='auto' is not searched with the size",
        ),
    ],
)
def test_a_range_the_search_cannot_take_is_refused_before_any_rank_communicates(options, words):
    with pytest.raises(PipelineConfigError, match="tensor_parallel=\\(1, 2\\)") as caught:
        PipelineOptions(tensor_parallel=(1, 2), **options).check()
    assert words in str(caught.value) and "\n" not in str(caught.value)
