"""``schedule="auto"`` on real gloo ranks: one choice on every rank, gradients as one process."""

from __future__ import annotations

import math

import pytest

from auto_schedule_workers import (
    changed_by_planning,
    chosen_and_trained,
    planned_at_first_step_cases,
    refused,
    refused_on_rank_1,
    stalled_in_trials,
)
from runtime_models import train_reference
from twobp.runtime import LaunchError, PipelineConfigError, launch
from twobp.sim import CostModel

N_MB = 4
BATCH = 8
TOL = 1e-10


@pytest.fixture(scope="module")
def profiled() -> list[dict]:
    return launch(
        chosen_and_trained, 2, "transformer", N_MB, BATCH, threads_per_rank=1, timeout=120
    )


def test_every_rank_runs_the_one_schedule_rank_0_chose(profiled):
    assert profiled[0]["schedule"] == profiled[1]["schedule"]
    assert profiled[0]["choice"] == profiled[1]["choice"]
    assert profiled[0]["partition"] == profiled[1]["partition"]
    choice = profiled[0]["choice"]
    assert choice.ok and choice.makespan > 0
    assert profiled[0]["shown"].startswith(f"schedule='auto' chose {choice.schedule}")
    # Over gloo, posting a boundary's message holds the sender: measured, and simulated.
    assert profiled[0]["send_overhead"] == profiled[1]["send_overhead"]
    # Posting one message holds the sender for less than a whole step, which posts one per
    # micro-batch beside its compute: the same clock under the same load.
    assert 0 < profiled[0]["send_overhead"] < min(profiled[0]["trial_times"])


def test_trial_steps_time_the_contenders_alike_on_every_rank_and_keep_the_fastest(profiled):
    times = profiled[0]["trial_times"]
    assert times == profiled[1]["trial_times"]
    assert len(times) == len(profiled[0]["contenders"]) >= 2
    assert all(0 < t < math.inf for t in times)
    chosen = profiled[0]["contenders"].index(profiled[0]["choice"])
    assert times[chosen] == min(times)
    assert "in trial steps, the fastest of" in profiled[0]["shown"]


def test_the_chosen_schedule_gives_the_single_process_gradients(profiled):
    reference = train_reference("transformer", N_MB, BATCH)
    for result in profiled:
        assert result["loss"] == pytest.approx(reference["losses"][0], abs=TOL, rel=0)
    grads = {**profiled[0]["grads"], **profiled[1]["grads"]}
    assert set(grads) == set(reference["grads"])
    for name, expected in reference["grads"].items():
        assert (grads[name] - expected).abs().max().item() < TOL, name


def test_given_costs_choose_without_profiling_and_memory_limit_bounds_the_choice():
    # W is cheap and F dear: the fastest schedules hold many micro-batches.
    costs = CostModel.uniform(2, 3.0, 1.0, 0.5, activation_bytes=100.0, weight_grad_bytes=100.0)
    free, bounded = launch(_two_choices, 2, costs, threads_per_rank=1, timeout=120)[0]
    assert free["choice"].peak_memory > 300
    assert bounded["choice"].peak_memory <= 300
    assert bounded["choice"].makespan >= free["choice"].makespan


def _two_choices(costs: CostModel) -> tuple[dict, dict]:
    free = chosen_and_trained("mlp", N_MB, BATCH, costs=costs)
    bounded = chosen_and_trained("mlp", N_MB, BATCH, costs=costs, memory_limit="300")
    return free, bounded


def test_a_memory_limit_nothing_fits_says_what_the_least_needs():
    costs = CostModel.uniform(2, activation_bytes=2**20, weight_grad_bytes=2**20)
    messages = launch(_refused_at_half_a_mib, 2, costs, threads_per_rank=1, timeout=120)
    assert messages[0] == messages[1]
    assert "no schedule fits memory_limit=512 KiB per rank" in messages[0]
    assert "needs the least (1 MiB)" in messages[0]


def _refused_at_half_a_mib(costs: CostModel) -> str:
    return refused("mlp", N_MB, BATCH, costs=costs, memory_limit="512KiB")


def test_costs_profile_places_zero_bubble_w_by_measured_costs():
    results = launch(_zb_h2_profiled, 2, threads_per_rank=1, timeout=120)
    reference = train_reference("mlp", N_MB, BATCH)
    assert results[0]["schedule"] == results[1]["schedule"]
    assert results[0]["choice"].schedule == "zb-h2"
    assert results[0]["choice"].policy == "fill"
    assert "zb-h2+2bp:fill" in results[0]["schedule"]
    grads = {**results[0]["grads"], **results[1]["grads"]}
    for name, expected in reference["grads"].items():
        assert (grads[name] - expected).abs().max().item() < TOL, name


def _zb_h2_profiled() -> dict:
    return chosen_and_trained(
        "mlp", N_MB, BATCH, schedule="zb-h2", costs="profile", two_bp_policy="fill"
    )


def test_planning_leaves_the_running_statistics_gradients_and_random_state_as_they_were():
    # Profiling, the contention runs and the trial steps train the blocks: BatchNorm
    # updates its statistics, dropout draws from the generator.
    changed = launch(changed_by_planning, 2, "conv", N_MB, BATCH, threads_per_rank=1, timeout=120)
    assert changed == [[], []]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("wrong", "said"),
    [
        ("example_input", "need example_input="),
        ("memory_limit", "'a lot'"),
        ("auto_trials", "auto_trials=-1"),
    ],
)
def test_a_rank_that_cannot_plan_stops_every_rank_before_the_measurements(wrong, said):
    messages = launch(refused_on_rank_1, 2, "mlp", N_MB, BATCH, wrong, timeout=60)
    assert messages[1].startswith("rank 1: ") and said in messages[1]
    assert messages[0].startswith("rank 1 reported: ") and said in messages[0]


def test_a_rank_stuck_in_a_trial_step_stops_the_others_within_the_timeout():
    timeout = 8.0
    with pytest.raises(LaunchError) as info:
        launch(
            stalled_in_trials,
            2,
            "transformer",
            N_MB,
            BATCH,
            timeout,
            threads_per_rank=1,
            grace_period=1.0,
            timeout=150,
        )
    by_rank = {f.rank: f for f in info.value.failures}
    waiting, stuck = by_rank[0], by_rank[1]
    assert waiting.error_type == "PeerTimeoutError", waiting.message
    assert f"waited more than {timeout:g} s" in waiting.message
    assert "rank 1 is stuck, slow or gone" in waiting.message
    # Rank 0 gave up on the pipeline's timeout (named above), not the group's 300 s, and the
    # launcher ended rank 1 as the cause.
    assert stuck.stuck


@pytest.fixture(scope="module")
def planned_at_first_step() -> list[dict]:
    # No example input and the count left to auto: the first step's batch plans both.
    cases = [("auto", {"auto_trials": 2})]
    return [
        rank[0]
        for rank in launch(
            planned_at_first_step_cases, 2, "mlp", 16, cases, threads_per_rank=1, timeout=240
        )
    ]


def test_auto_without_an_example_input_plans_on_the_first_steps_batch(planned_at_first_step):
    first, second = planned_at_first_step
    assert not first["planned_early"]
    # Until then parameters() are every block's, so an optimizer can be built first.
    assert first["parameters_before"] == second["parameters_before"] > first["parameters_after"]
    assert "run a step first, or call plan_on(inputs)" in first["refused_before"]
    assert first["schedule"] == second["schedule"]
    assert first["choice"] == second["choice"]
    assert first["trial_times"] == second["trial_times"]


def test_auto_microbatches_choose_the_count_among_those_that_cut_the_batch(planned_at_first_step):
    first, _ = planned_at_first_step
    counts = {c.n_microbatches for c in first["ranking"] if c.ok}
    assert counts == {2, 4, 8, 16}
    assert first["n_microbatches"] == first["choice"].n_microbatches
    assert f", m={first['n_microbatches']}" in first["shown"].splitlines()[0]
    assert len(first["trial_times"]) == len(first["contenders"]) >= 1


def test_the_count_auto_chose_gives_the_single_process_gradients(planned_at_first_step):
    first, second = planned_at_first_step
    reference = train_reference("mlp", first["n_microbatches"], 16)
    for result in planned_at_first_step:
        assert result["loss"] == pytest.approx(reference["losses"][0], abs=TOL, rel=0)
        assert math.isfinite(result["second"])
    grads = {**first["grads"], **second["grads"]}
    assert set(grads) == set(reference["grads"])
    for name, expected in reference["grads"].items():
        assert (grads[name] - expected).abs().max().item() < TOL, name


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"schedule": "1f1b", "n_microbatches": "auto"}, "n_microbatches='auto' is chosen by"),
        ({"schedule": "auto", "n_microbatches": "many"}, "n_microbatches='many'"),
        (
            {"schedule": "auto", "n_microbatches": "auto", "costs": CostModel.uniform(2)},
            "drop costs=",
        ),
    ],
)
def test_auto_microbatches_are_refused_where_nothing_chooses_them(options, said):
    from twobp.runtime.setup.pipeline_plan import check_microbatches

    with pytest.raises(PipelineConfigError, match=said):
        check_microbatches(options["schedule"], options["n_microbatches"], options.get("costs"))
