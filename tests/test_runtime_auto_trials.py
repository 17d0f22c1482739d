"""Trial steps of ``schedule="auto"``: the fastest measured contender wins, whatever the
simulator said; failures leave the trial; the blocks are released for the next one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from twobp.engine import TwoStageBackwardError
from twobp.runtime import Pipeline
from twobp.runtime.base.group import Membership
from twobp.runtime.errors import PeerStepFailedError, PeerTimeoutError, PipelineConfigError
from twobp.runtime.setup.auto.plan import (
    CONTENDER_WINDOW,
    AutoPlan,
    Contender,
    OptionSpace,
    choose_plan,
)
from twobp.runtime.setup.auto.trials import (
    MAX_TRIAL_ROUNDS,
    TRIAL_ROUNDS,
    run_trials,
    stand_in_loss,
    trial_times,
)
from twobp.schedule import generate
from twobp.sim import CostModel
from twobp.sim.from_profile import partition_for
from twobp.sim.planner import Candidate
from twobp.sim.search import options

ALONE = Membership.of(0, 1, 1, None, None)
"""A world of one process: the trials' agreement is the identity."""


class Clock:
    """A clock that only the fake pipelines' steps move."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakePipeline:
    """A contender's pipeline whose steps take ``seconds`` each on ``clock``; it records
    its steps in ``log`` by name, and checks that it holds the blocks when it steps."""

    def __init__(
        self,
        name: str,
        clock: Clock,
        seconds: float,
        fails: BaseException | None,
        log: list[str],
        holder: list[str | None],
    ) -> None:
        self.name, self.clock, self.seconds, self.fails = name, clock, seconds, fails
        self.log, self.holder = log, holder
        self.closed = False
        assert holder[0] is None, f"{name} built while {holder[0]} holds the blocks"
        holder[0] = name

    def step(self, inputs: object, targets: object) -> float:
        assert self.holder[0] == self.name, f"{self.name} steps without the blocks"
        self.log.append(self.name)
        if self.fails is not None:
            raise self.fails
        self.clock.now += self.seconds
        return 0.0

    def release_blocks(self) -> None:
        assert self.holder[0] == self.name
        self.holder[0] = None

    def claim_blocks(self) -> None:
        assert self.holder[0] is None, f"{self.name} claims while {self.holder[0]} holds"
        self.holder[0] = self.name

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def contenders(*names: str) -> tuple[Contender, ...]:
    """One contender per name, simulated in the order given (the first the fastest)."""
    costs = CostModel.uniform(2)
    return tuple(
        Contender(
            Candidate(name, "paper", makespan=1.0 + i),
            replace(generate("1f1b", 2, 4), name=name),
            (1, 1),
            costs,
        )
        for i, name in enumerate(names)
    )


def plan_of(shortlist: tuple[Contender, ...]) -> AutoPlan:
    first = shortlist[0]
    ranking = tuple(c.candidate for c in shortlist)
    return AutoPlan(
        first.candidate, ranking, first.schedule, first.partition, first.costs, None, shortlist
    )


def builder(clock: Clock, seconds: dict[str, float], fails: dict[str, BaseException] = {}):  # noqa: B006
    """A build of fake pipelines; the pipelines built, and the names of the steps run."""
    built: list[FakePipeline] = []
    steps: list[str] = []
    holder: list[str | None] = [None]

    def build(contender: Contender) -> FakePipeline:
        name = contender.candidate.schedule
        if isinstance(fails.get(name), PipelineConfigError):
            raise fails[name]
        pipe = FakePipeline(name, clock, seconds.get(name, 1.0), fails.get(name), steps, holder)
        built.append(pipe)
        return pipe

    return build, built, steps


def test_the_fastest_measured_contender_is_chosen_not_the_first_simulated():
    clock = Clock()
    shortlist = contenders("a", "b", "c")
    build, built, _ = builder(clock, {"a": 0.30, "b": 0.20, "c": 0.29})
    cpu = torch.device("cpu")
    plan = run_trials(plan_of(shortlist), build, [], torch.zeros(2, 3), ALONE, cpu, clock=clock)
    assert plan.trial_times == pytest.approx((0.30, 0.20, 0.29))
    assert plan.choice == shortlist[1].candidate
    assert plan.schedule is shortlist[1].schedule
    assert plan.trial_time(shortlist[1].candidate) == pytest.approx(0.20)
    assert "measured 200 ms in trial steps, the fastest of 3 tried" in plan.summary()
    assert all(p.closed for p in built)


def test_contenders_take_turns_and_those_far_behind_leave_from_the_second_round():
    clock = Clock()
    build, built, steps = builder(clock, {"a": 0.30, "b": 0.20, "c": 0.21})
    times = trial_times(contenders("a", "b", "c"), build, None, ALONE, clock, TRIAL_ROUNDS)
    assert times == pytest.approx([0.30, 0.20, 0.21])
    # A warm-up round in reverse, measured rounds alternating; "a", more than 10% behind
    # "b", leaves after the second measured round.
    rounds = ["cba", "abc", "cba", "bc", "cb"]
    assert steps == [name for r in rounds[: TRIAL_ROUNDS + 1] for name in r]
    assert all(p.closed for p in built)


def test_contenders_too_close_to_tell_apart_run_more_rounds():
    clock = Clock()
    build, _, steps = builder(clock, {"a": 0.200, "b": 0.201})
    times = trial_times(contenders("a", "b"), build, None, ALONE, clock, TRIAL_ROUNDS)
    assert times == pytest.approx([0.200, 0.201])
    assert steps.count("a") == steps.count("b") == MAX_TRIAL_ROUNDS + 1


def test_a_contender_that_fails_leaves_the_trial_and_a_lost_peer_stops_it(caplog):
    clock = Clock()
    build, _, _ = builder(
        clock,
        {"a": 0.3, "b": 0.1, "c": 0.2},
        {"b": RuntimeError("out of memory"), "c": PipelineConfigError("no such partition")},
    )
    plan = run_trials(
        plan_of(contenders("a", "b", "c")),
        build,
        [],
        torch.zeros(2),
        ALONE,
        torch.device("cpu"),
        clock=clock,
    )
    assert plan.trial_times[0] == pytest.approx(0.3)
    assert math.isinf(plan.trial_times[1]) and math.isinf(plan.trial_times[2])
    assert plan.choice.schedule == "a"
    assert "failed" in plan.table()
    assert "a trial step failed: RuntimeError: out of memory" in caplog.text
    assert "the trial pipeline of c with 2BP (paper) was not built: no such partition" in (
        caplog.text
    )
    lost = PeerTimeoutError("rank 1 did not answer", 0, 1)
    failed = PeerStepFailedError("rank 1 failed in its F", 0, 1)
    build, _, steps = builder(clock, {"a": 0.3, "b": 0.1}, {"b": failed})
    assert trial_times(contenders("a", "b"), build, None, ALONE, clock, TRIAL_ROUNDS)[1] == math.inf
    assert steps == ["b", "a", "a"]  # "b" fails its warm-up; "a" alone stops after a round
    build, _, _ = builder(clock, {}, {"b": lost})
    with pytest.raises(PeerTimeoutError):
        trial_times(contenders("a", "b"), build, None, ALONE, clock, TRIAL_ROUNDS)


def test_when_no_contender_runs_the_simulator_choice_stays():
    shortlist = contenders("a", "b")
    plan = plan_of(shortlist).settled([math.inf, math.inf])
    assert plan.choice == shortlist[0].candidate
    assert "trial steps" not in plan.summary()


def test_the_stand_in_loss_differentiates_every_float_output_that_needs_it():
    x = torch.ones(4, 3, requires_grad=True)
    loss = stand_in_loss((x * 2, torch.arange(4)), None)
    loss.backward()
    assert x.grad is not None and torch.allclose(x.grad, torch.full((4, 3), 2 / 12))
    with pytest.raises(PipelineConfigError, match="auto_trials=0"):
        stand_in_loss(torch.arange(4), None)


def test_a_closed_pipeline_releases_its_blocks_for_the_next():
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4) for _ in range(2)]
    loss = nn.MSELoss()
    first = Pipeline(blocks, loss, "1f1b", n_microbatches=2, device="cpu")
    first.close()
    second = Pipeline(blocks, loss, "1f1b", n_microbatches=2, device="cpu")
    assert math.isfinite(second.step(torch.ones(4, 4), torch.zeros(4, 4)))
    second.close()


def test_the_contenders_are_the_choice_and_the_fastest_of_each_other_schedule():
    n_blocks, m = 8, 8
    sizes_for = partition_for(n_blocks, None, None)

    def costs_for(n_stages: int) -> CostModel:
        per_stage = n_blocks / n_stages
        return CostModel.uniform(
            n_stages, per_stage, per_stage, per_stage, activation_bytes=per_stage
        )

    plan = choose_plan(
        [OptionSpace(None, m, options(m), costs_for, sizes_for)], 2, None, contenders=100
    )
    shortlist = plan.contenders
    assert len(shortlist) >= 2 and shortlist[0].candidate == plan.choice
    kinds = {
        (c.candidate.schedule, c.candidate.stages_per_rank, c.candidate.policy == "off")
        for c in shortlist
    }
    assert len(kinds) == len(shortlist)
    runs = {(str(replace(c.schedule, name="").actions), c.partition) for c in shortlist}
    assert len(runs) == len(shortlist)
    slowest = plan.choice.makespan * (1 + CONTENDER_WINDOW)
    assert all(c.candidate.makespan <= slowest for c in shortlist)
    assert [c.candidate.makespan for c in shortlist] == sorted(
        c.candidate.makespan for c in shortlist
    )
    space = [OptionSpace(None, m, options(m), costs_for, sizes_for)]
    assert choose_plan(space, 2, None, contenders=1).contenders == ()
    limit = plan.choice.peak_memory
    bounded = choose_plan(space, 2, limit, contenders=6).contenders
    assert bounded and all(c.candidate.peak_memory <= limit for c in bounded)


def test_pipelines_on_one_model_take_turns_by_releasing_and_claiming_the_blocks():
    torch.manual_seed(0)
    blocks = [nn.Linear(4, 4) for _ in range(2)]
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    first = Pipeline(blocks, nn.MSELoss(), "1f1b", n_microbatches=2, device="cpu")
    with pytest.raises(TwoStageBackwardError, match="already deferred"):
        Pipeline(blocks, nn.MSELoss(), "gpipe", n_microbatches=2, device="cpu")
    first.release_blocks()
    with pytest.raises(PipelineConfigError, match="call claim_blocks"):
        first.step(x, y)
    second = Pipeline(blocks, nn.MSELoss(), "gpipe", n_microbatches=2, device="cpu")
    with pytest.raises(TwoStageBackwardError, match="already deferred"):
        first.claim_blocks()
    second.step(x, y)
    by_second = [p.grad.clone() for p in second.parameters()]
    second.zero_grad()
    second.release_blocks()
    first.claim_blocks()
    first.step(x, y)
    for p, expected in zip(first.parameters(), by_second, strict=True):
        torch.testing.assert_close(p.grad, expected)
    first.close()
    second.close()
