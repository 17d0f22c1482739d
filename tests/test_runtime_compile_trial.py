"""``compile=True`` keeps each stage's compiled blocks only where the first training steps
found them faster than eager: the trial's steps, its choice, and two pipelines where one
way is made slow on purpose (on a clock of the test's own, see compile_workers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from compile_workers import N_BLOCKS, N_MB, SLOW_CALL, trial_choices
from twobp.runtime import launch
from twobp.runtime.setup.compile_trial import (
    TRIALS,
    WARMUP,
    CompileTrial,
    choose,
    stage_seconds,
    trial_mode,
)
from twobp.schedule.action import Action, Kind
from twobp.timeline import Span


def test_the_trial_warms_up_compiled_then_alternates_then_stops() -> None:
    ways = [trial_mode(k) for k in range(WARMUP + 2 * TRIALS + 2)]
    assert ways[:WARMUP] == ["compiled"] * WARMUP
    assert ways[WARMUP : WARMUP + 2 * TRIALS] == ["eager", "compiled"] * TRIALS
    assert ways[WARMUP + 2 * TRIALS :] == [None, None]
    assert choose([1.0, 1.0, 9.0], [0.9, 0.9, 0.1]) == "compiled"
    assert choose([1.0, 1.0, 0.1], [1.1, 1.1, 0.1]) == "eager"
    assert choose([1.0], [1.0]) == "eager"  # a tie compiles nothing
    # Steps lengthened at random (by other work on the machine) in most of one way's steps:
    # the fastest of each is what the way costs.
    assert choose([1.0, 1.0, 1.0], [1.3, 0.9, 1.3]) == "compiled"
    assert choose([1.3, 0.9, 1.3], [1.0, 1.0, 1.0]) == "eager"
    spans = [
        Span(0, Action(0, Kind.FORWARD, (0,)), 0.0, 1.0),
        Span(0, Action(0, Kind.BACKWARD_INPUT, (0,)), 1.0, 1.5),
        Span(0, Action(2, Kind.FORWARD, (0,)), 1.5, 3.5),
    ]
    assert stage_seconds(spans, [0, 1]) == {0: 1.5, 1: 0.0}


def test_a_trial_switches_the_blocks_and_keeps_the_faster_way() -> None:
    """Stage 0's compiled steps take half its eager ones, stage 1's twice: each keeps its own
    faster way; a block that was not compiled in place takes no part."""
    stages = {s: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for s in (0, 1)}
    stages[0][0].compile(backend="eager")
    stages[1][0].compile(backend="eager")
    stages[1][1].compile(backend="eager")
    impls = {s: [b._compiled_call_impl for b in m] for s, m in stages.items()}
    trial = CompileTrial(stages)
    for k in range(WARMUP + 2 * TRIALS):
        trial.before_step()
        way = trial_mode(k)
        for s, module in stages.items():
            for block, impl in zip(module, impls[s], strict=True):
                expected = impl if way == "compiled" else None
                assert block._compiled_call_impl is expected
        eager = way == "eager"
        spans = [
            Span(0, Action(0, Kind.FORWARD, (0,)), 0.0, 2.0 if eager else 1.0),
            Span(0, Action(1, Kind.FORWARD, (0,)), 0.0, 1.0 if eager else 2.0),
        ]
        assert trial.choice == {0: None, 1: None}
        trial.after_step(spans)
    assert trial.choice == {0: "compiled", 1: "eager"}
    assert stages[0][0]._compiled_call_impl is impls[0][0]
    assert stages[1][0]._compiled_call_impl is None and stages[1][1]._compiled_call_impl is None
    assert trial.times[0] == {"eager": [2.0] * TRIALS, "compiled": [1.0] * TRIALS}
    trial.before_step()  # past the trial, nothing moves
    trial.after_step([])
    assert stages[1][0]._compiled_call_impl is None
    assert trial.steps == WARMUP + 2 * TRIALS


@pytest.fixture(scope="module", params=["eager", "compiled"])
def chosen(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, launch(trial_choices, 2, request.param, threads_per_rank=1, timeout=600)


@pytest.mark.timeout(600)
def test_each_stage_keeps_the_way_its_steps_ran_faster(
    chosen: tuple[str, list[dict[str, Any]]],
) -> None:
    slow, results = chosen
    for rank, result in enumerate(results):
        choices = result["choices"]
        assert choices[WARMUP + 2 * TRIALS - 2] == {rank: None}, rank
        keep = "eager" if slow == "compiled" else "compiled"
        assert choices[WARMUP + 2 * TRIALS - 1] == choices[-1] == {rank: keep}, (rank, result)
        # Timed on the workers' virtual clock: only the slow blocks or graphs move it, by
        # SLOW_CALL a call, at least once per block and micro-batch.
        times = result["times"][rank]
        assert times[keep] == [0.0] * TRIALS, (rank, times)
        assert times[slow] == [times[slow][0]] * TRIALS, (rank, times)
        assert times[slow][0] >= N_BLOCKS // 2 * N_MB * SLOW_CALL, (rank, times)
        # the step after the trial: the gradients of eager autograd
        grads, eager = result["grads"]["trial"], result["grads"]["eager"]
        assert grads.keys() == eager.keys() and grads
        for name, grad in eager.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)
