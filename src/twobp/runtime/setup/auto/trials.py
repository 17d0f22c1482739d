"""Trial steps: run ``schedule="auto"``'s contenders for a few steps, keep the fastest.

The simulator ranks schedules by the blocks' profiled costs. On a real
machine, schedules it puts within a few per cent of each other can differ by
10-20% (time between actions, caches, messages it does not model), and the
one it puts first is not always the fastest. So, before the pipeline
settles, every rank builds a pipeline of each contender of the plan
(:attr:`twobp.runtime.setup.auto.plan.AutoPlan.contenders`: the fastest
simulated candidate of each schedule and stage count) on the same blocks,
and they take turns, one step each per round (the ranks meet at a barrier
before each), on the example micro-batch repeated to a batch: a warm-up
round, then :data:`TRIAL_ROUNDS` measured rounds (up to
:data:`MAX_TRIAL_ROUNDS` while the two fastest are within :data:`CLOSE`),
every other one in the reverse order, so that a change of the machine's
load weighs on all alike. (The 2BP engine defers a module for one
pipeline at a time: each claims the blocks for its step and releases them
after.) From the second measured round, the contenders more than
:data:`DROP` slower than the fastest leave. A contender's time is the median
of its steps on the slowest rank, the same figure on every rank, so every
rank keeps the same schedule.

The steps are real steps with a stand-in loss (the mean of the last block's
outputs; the blocks are timed without the loss when profiled too); their
gradients are dropped, and the blocks' gradients, buffers (BatchNorm's
running statistics) and the random state are left as they were. A
contender that cannot be built or whose step fails leaves the trial
(``inf``, with a warning on the ``twobp`` logger saying why); if none runs,
the simulator's choice stays, and its first step raises what went wrong.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Protocol

import torch
from torch import Tensor, nn

from twobp.partition.profiler import restored
from twobp.runtime.base.group import Membership
from twobp.runtime.communication.collective import all_gather_objects, barrier
from twobp.runtime.errors import PeerError, PeerStepFailedError, PipelineConfigError
from twobp.runtime.execution.microbatch import Batch, concat_microbatches
from twobp.runtime.setup.auto.plan import AutoPlan, Contender
from twobp.schedule import ScheduleError
from twobp.sim.search import describe

TRIAL_ROUNDS = 4
"""Measured rounds of the trial (after a warm-up round): steps of a contender that stays."""
MAX_TRIAL_ROUNDS = 8
"""The most measured rounds, while the two fastest are within :data:`CLOSE` of each other."""
DROP = 0.10
"""A contender this much slower than the fastest leaves the trial (from the second round)."""
CLOSE = 0.03
"""Two contenders this close after :data:`TRIAL_ROUNDS` rounds run more, to tell them apart."""

log = logging.getLogger("twobp")


class TrialPipeline(Protocol):
    """What a trial runs: a pipeline of one contender."""

    def step(self, inputs: Batch | None, targets: Batch | None) -> float: ...

    def release_blocks(self) -> None: ...

    def claim_blocks(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def close(self) -> None: ...


Build = Callable[[Contender], TrialPipeline]
"""Builds a contender's pipeline (collective; raises ``PipelineConfigError`` or
``ScheduleError`` on every rank if it cannot)."""


def stand_in_loss(output: Batch, target: Batch) -> Tensor:
    """The loss of a trial step: the mean of every float output that needs a gradient."""
    tensors = output if isinstance(output, tuple) else (output,)
    means = [t.float().mean() for t in tensors if t.is_floating_point() and t.requires_grad]
    if not means:
        raise PipelineConfigError(
            "the last block returns no float tensor that needs a gradient, so a trial step "
            "has nothing to differentiate; pass auto_trials=0"
        )
    return torch.stack(means).sum()


def run_trials(
    plan: AutoPlan,
    build: Build,
    blocks: Sequence[nn.Module],
    example_input: Batch | None,
    world: Membership,
    device: torch.device,
    rounds: int = TRIAL_ROUNDS,
    clock: Callable[[], float] | None = None,
    timeout: float = 300.0,
    batch: Batch | None = None,
) -> AutoPlan:
    """Measure the plan's contenders in trial steps; the plan of the fastest.

    Collective: every rank calls it with the same plan.

    Args:
        plan: what ``schedule="auto"`` simulated, with its contenders.
        build: builds a contender's pipeline (of ``blocks``, with :func:`stand_in_loss`).
        blocks: the whole model's blocks (their state is restored afterwards).
        example_input: one micro-batch of model inputs; a step takes it
            ``n_microbatches`` times (as inputs and as the ignored targets).
        batch: the batch a step takes instead (the first step's, where the
            pipeline plans on it; contenders of other micro-batch counts cut it
            into their own).
        world: the group.
        device: where the ranks compute (the clock waits for it).
        rounds: measured rounds (see :func:`trial_times`).
        clock: seconds now (None: ``time.perf_counter`` once the device's queued work is done).
        timeout: seconds a rank waits for the others at the barrier before a timed step.

    Returns:
        :meth:`AutoPlan.settled` by the measured times (the plan as it is
        without contenders).
    """
    if len(plan.contenders) < 2:
        return plan
    if batch is None:
        assert example_input is not None, "trial steps need an example input or a batch"
        batch = concat_microbatches([example_input] * plan.schedule.n_microbatches)
    with _left_as_found(blocks, device):
        times = trial_times(
            plan.contenders, build, batch, world, clock or _clock(device), rounds, timeout
        )
    for contender, t in zip(plan.contenders, times, strict=True):
        log.debug(
            "schedule='auto' trial: %s, predicted %.4g ms, measured %s",
            describe(contender.candidate),
            contender.candidate.makespan * 1e3,
            f"{t * 1e3:.4g} ms" if math.isfinite(t) else "nothing (it failed)",
        )
    return plan.settled(times)


def trial_times(
    contenders: Sequence[Contender],
    build: Build,
    batch: Batch,
    world: Membership,
    clock: Callable[[], float],
    rounds: int = TRIAL_ROUNDS,
    timeout: float = 300.0,
) -> list[float]:
    """The step time of each contender: the slowest rank's median of its measured steps.

    Every contender's pipeline is built (and releases the blocks for the
    next: the 2BP engine defers a module for one pipeline at a time); then
    they take turns, one step each per round, claiming the blocks for it: a
    warm-up round, then ``rounds`` measured ones, every other one in the
    reverse order, and more (up to :data:`MAX_TRIAL_ROUNDS` in all) while
    the second fastest is within :data:`CLOSE` of the fastest. From the
    second measured round, those more than :data:`DROP` slower than the
    fastest leave. ``inf`` for one that could not be built or whose step
    failed.
    """
    pipes: dict[int, TrialPipeline] = {}
    steps: list[list[float]] = [[] for _ in contenders]
    failed: set[int] = set()
    agreed = [math.inf] * len(contenders)
    try:
        for i, contender in enumerate(contenders):
            try:
                pipe = build(contender)
            except (PipelineConfigError, ScheduleError) as exc:
                log.warning(
                    "schedule='auto': the trial pipeline of %s was not built: %s",
                    describe(contender.candidate),
                    exc,
                )
                failed.add(i)
                continue
            pipe.release_blocks()
            pipes[i] = pipe
        live = sorted(pipes)
        for r in range(max(rounds, MAX_TRIAL_ROUNDS) + 1):
            for i in live if r % 2 else live[::-1]:
                pipe = pipes[i]
                pipe.claim_blocks()
                # The ranks start together: the last step's tail on one rank is not this one's.
                barrier(world, timeout, "before a trial step of schedule='auto'")
                elapsed = _timed_step(pipe, batch, clock)
                pipe.release_blocks()
                if math.isinf(elapsed):  # on every rank alike: the step failed on all
                    failed.add(i)
                elif r:  # round 0 warms up
                    steps[i].append(elapsed)
            # Every rank learns every rank's figures: all keep and drop alike.
            mine = ([statistics.median(s) if s else 0.0 for s in steps], sorted(failed))
            figures = all_gather_objects(world, mine)
            gone = {i for _, lost in figures for i in lost}
            agreed = [
                math.inf if i in gone else max(medians[i] for medians, _ in figures)
                for i in range(len(contenders))
            ]
            live = [i for i in live if i not in gone]
            if r >= 2 and live:
                fastest = min(agreed[i] for i in live)
                live = [i for i in live if agreed[i] <= fastest * (1 + DROP)]
            if len(live) < 2 and r >= 1:
                break
            if r >= rounds:
                first, second = sorted(agreed[i] for i in live)[:2]
                if second > first * (1 + CLOSE):
                    break
    finally:
        for pipe in pipes.values():
            pipe.close()
    return agreed


def _timed_step(pipe: TrialPipeline, batch: Batch, clock: Callable[[], float]) -> float:
    """Seconds of one step of ``pipe``, ``inf`` if it failed (on this rank or a peer)."""
    start = clock()
    try:
        pipe.step(batch, batch)
    except PeerError as exc:
        if not isinstance(exc, PeerStepFailedError):
            raise  # a peer is gone: nothing more can run
        log.warning("schedule='auto': a trial step failed on a peer: %s", exc)
        return math.inf
    except Exception as exc:  # the contender fails, the others go on
        log.warning("schedule='auto': a trial step failed: %s: %s", type(exc).__name__, exc)
        return math.inf
    finally:
        pipe.zero_grad(set_to_none=True)
    return clock() - start


def _clock(device: torch.device) -> Callable[[], float]:
    """A clock that first waits for the device's queued work (CUDA runs asynchronously)."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


@contextmanager
def _left_as_found(blocks: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Run with the blocks' gradients, buffers and the random state restored afterwards."""
    with ExitStack() as stack:
        stack.enter_context(
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        )
        for block in blocks:
            stack.enter_context(restored(block))
        yield
