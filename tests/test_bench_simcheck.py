"""The simulator check of the bench: contention measured on real ranks, alone costs, bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from bench_workers import exclusive_contention, link, sleeping_contention
from twobp.runtime import launch
from twobp.schedule import generate
from twobp.schedule.lowering import add_reductions
from twobp.sim import simulate
from twobp.sim.reduction import with_reductions
from twobp_bench.profile import measure_contention
from twobp_bench.simcheck import replayed_step, simulated_step, stage_costs


@dataclass(frozen=True)
class Block:
    forward: float
    backward_input: float
    backward_weight: float
    backward_full: float
    activation_bytes: int = 0
    weight_grad_bytes: int = 0
    output_bytes: int = 0
    parameter_bytes: int = 0


@dataclass(frozen=True)
class Profile:
    blocks: tuple[Block, ...]
    weight_concat: tuple[dict[int, float], ...]
    link_latency: float = 0.0
    link_bandwidth: float = float("inf")
    contention: float = 1.0
    reduce_bandwidth: float = float("inf")


def _profile(contention: float) -> Profile:
    blocks = tuple(Block(2.0, 2.0, 1.0, 3.0) for _ in range(4))
    return Profile(blocks, tuple({1: 1.0, 4: 2.0} for _ in blocks), contention=contention)


def test_profiled_costs_become_alone_costs_with_the_contention():
    profiles = [_profile(2.0), _profile(2.0)]
    model = stage_costs(profiles, [2, 2], [0, 1])
    # Profiled with both ranks busy: alone, each action takes half as long.
    assert model.forward == (2.0, 2.0)
    assert model.backward_full == (3.0, 3.0)
    assert model.weight_concat == ({1: 1.0, 4: 2.0}, {1: 1.0, 4: 2.0})
    assert model.contention == 2.0


def test_contention_shortens_a_schedule_with_bubbles_but_not_its_overlapped_work():
    schedule = generate("gpipe", n_ranks=2, n_microbatches=4)
    plain = simulated_step(schedule, [_profile(1.0)] * 2, [2, 2])
    shared = simulated_step(schedule, [_profile(2.0)] * 2, [2, 2])
    # A stage holds 2 blocks: profiled F = 4 and B = 6. Without contention GPipe
    # takes (m + p - 1)(F + B) = 50. Profiled under contention 2, the alone times
    # are F = 2 and B = 3, and an action beside one on the other rank takes twice
    # that: 0F0 alone [0, 2]; three overlapped pairs of F, 4 each, to 14; 1F3 and
    # 1B0 alone to 19; three overlapped pairs of B, 6 each, to 37; 0B3 alone to 40.
    # The overlapped middle runs as fast as profiled, the lonely ends twice as fast.
    assert plain.makespan == 50.0
    assert shared.makespan == 40.0
    assert shared.busy == (35.0, 35.0)


def test_contention_is_one_without_a_process_group():
    assert measure_contention(lambda: None, torch.device("cpu")) == 1.0


@pytest.mark.timeout(120)
def test_contention_of_work_that_shares_nothing_is_about_one():
    # Two real ranks that sleep: running "together" costs them nothing.
    # Sleeps of 0.2 s: a wake-up late by tens of milliseconds on a loaded machine moves
    # the ratio by a few tenths at most.
    ratios = launch(sleeping_contention, 2, 0.2, timeout=90)
    assert ratios[0] == ratios[1]
    assert 0.8 < ratios[0] < 1.5


@pytest.mark.timeout(120)
def test_contention_of_work_that_waits_for_a_shared_resource(tmp_path):
    # Together, one rank waits a whole run for the other: ratios 1 and about 2.
    ratios = launch(exclusive_contention, 2, str(tmp_path / "lock"), 0.2, timeout=90)
    assert ratios[0] == ratios[1]
    assert 1.3 < ratios[0] < 2.5


@pytest.mark.timeout(120)
def test_the_link_between_ranks_0_and_1_is_measured_on_both():
    links = launch(link, 2, 2**16, timeout=90)
    assert links[0] == links[1]
    latency, bandwidth = links[0]
    assert 0 < latency < 1 and bandwidth > 0


def test_a_replay_walks_each_action_at_its_mean_time():
    # One rank, one stage, two micro-batches: F F B B. One of the three measured Fs was
    # interrupted; every step pays its share of such tails, which a median leaves out.
    seconds = {"0:F:1": [1.0, 1.0, 4.0], "0:B:1": [3.0, 3.0]}
    replay = replayed_step({0: ["0F0", "0F1", "0B0", "0B1"]}, [0], 2, seconds, (0.0, math.inf))
    assert replay.makespan == pytest.approx(2 * 2.0 + 2 * 3.0)


def test_the_simulator_check_costs_the_reductions_of_replicated_stages():
    # Chimera at p = 2 holds every stage on both ranks: each step all-reduces them all.
    blocks = tuple(Block(2.0, 2.0, 1.0, 3.0, parameter_bytes=10**9) for _ in range(4))
    profile = Profile(blocks, tuple({1: 1.0} for _ in blocks), link_bandwidth=1e9)
    schedule = add_reductions(generate("chimera", 2, 4))
    costs = stage_costs([profile, profile], [2, 2], schedule.placement)
    unreduced = simulate(schedule, costs)
    checked = simulated_step(schedule, [profile, profile], [2, 2])
    planned = simulate(*with_reductions(generate("chimera", 2, 4), costs))
    assert checked.makespan == pytest.approx(planned.makespan)
    assert checked.makespan > unreduced.makespan + 1.0
    # An all-reduce measured slower than the link (summing and copying) takes longer.
    slow = replace(profile, reduce_bandwidth=1e8)
    assert stage_costs([slow, slow], [2, 2], schedule.placement).reduce_bandwidth == 1e8
    assert simulated_step(schedule, [slow, slow], [2, 2]).makespan > checked.makespan + 1.0
    # The same schedule as two data-parallel copies reduces over four replicas: longer still.
    assert simulated_step(schedule, [profile, profile], [2, 2], data_parallel=2).makespan > (
        checked.makespan
    )


def test_a_replay_counts_the_reductions_it_is_given():
    schedule = add_reductions(generate("chimera", 2, 2))
    run = {rank: [str(a) for a in actions] for rank, actions in schedule.actions.items()}
    seconds = {f"{s}:{kind}:1": [1.0] for s in range(4) for kind in ("F", "B")}

    def replay(reduce):
        return replayed_step(
            run, schedule.placement, 2, seconds, (0.0, math.inf), n_pipelines=2, reduce=reduce
        )

    assert replay((5.0,) * 4).makespan > replay(None).makespan + 5.0
