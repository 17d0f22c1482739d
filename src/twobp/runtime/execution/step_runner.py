"""How a pipeline runs one step on this rank and settles it with the others.

:class:`StepRunner`, which a rank's parts hold (:mod:`twobp.runtime.setup.rank_parts`), runs the
lowered schedule of one step: it builds the step's channel and dispatcher,
and when the step fails part-way it completes the transfers and gradient
reductions that peers wait for, then settles the step with every rank (the
loss, or who failed, where and why: :mod:`twobp.runtime.execution.step_end`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from twobp.runtime.base.topology import Topology
from twobp.runtime.communication.channel import StepChannel, order_only_matching
from twobp.runtime.communication.links import Links
from twobp.runtime.communication.reduction import GradientReducer
from twobp.runtime.errors import PeerError
from twobp.runtime.execution.clock import StepClock
from twobp.runtime.execution.residency import Residency
from twobp.runtime.execution.stage import Stage
from twobp.runtime.execution.step_end import Failure, StepEnd, end_step, lost_peer
from twobp.runtime.execution.step_run import (
    StepResult,
    StepRun,
    StepTimes,
    reductions_wait_for_transfers,
)
from twobp.runtime.execution.step_start import StepBatches
from twobp.schedule.action import Kind
from twobp.schedule.gradient_scatter import scattered_each_w_by_rank
from twobp.schedule.schedule import Schedule
from twobp.schedule.transfers import CommPlan
from twobp.schedule.two_bp import places_weights_at_run_time
from twobp.timeline import Span


class StepRunner:
    """Runs the lowered schedule of one step on this rank and settles it with the others.

    One per pipeline: :func:`twobp.runtime.setup.rank_parts.build_rank` builds it once its stages
    and reducer exist and keeps what the last step measured here (:attr:`spans`,
    :attr:`times`, :attr:`peak_stashed_bytes`).

    Args:
        rank: this process's rank in the group.
        pp_rank: its pipeline rank (its row of the schedule).
        device: where the stages compute.
        timeout: seconds a rank waits on a peer.
        topology: where each stage runs.
        n_microbatches: micro-batches per step.
        stages: this rank's stages, by stage.
        reducer: the gradient reductions of replicated stages (None: none).
        weight_group_size: the engine's concatenation cap of each ``W``.
        links: the process groups of the transfers to and from every peer
            (None: the rank has no peers).
        order_only: send every transfer with tag 0 (the pipeline option
            ``order_only_matching``; its environment variable is read here, once).
        reduce_after_transfers: start the reductions of ``R`` after the step's
            transfers on any backend (the pipeline option; its environment
            variable is read here, once).
    """

    def __init__(
        self,
        *,
        rank: int,
        pp_rank: int,
        device: torch.device,
        timeout: float,
        topology: Topology,
        n_microbatches: int,
        stages: dict[int, Stage],
        reducer: GradientReducer | None,
        weight_group_size: int | None,
        links: Links | None = None,
        order_only: bool = False,
        reduce_after_transfers: bool = False,
    ) -> None:
        self.rank = rank
        self.pp_rank = pp_rank
        self.device = device
        self.timeout = timeout
        self.topology = topology
        self.n_microbatches = n_microbatches
        self.stages = stages
        self._reducer = reducer
        self._weight_group_size = weight_group_size
        self._links = links
        self._order_only = order_only_matching(order_only)
        self._reductions_after_transfers = reductions_wait_for_transfers(
            topology.members.backend, reduce_after_transfers
        )
        self.failure: Failure | None = None
        """How and where the last failed step failed on this rank."""
        self.spans: list[Span] = []
        """The compute spans of this rank in the last step."""
        self.waits: list[Span] = []
        """Where this rank waited on peers in the last step: its receives, and (as its last
        ``R``) the wait for its gradient reductions at the end of the step."""
        self.times = StepTimes()
        """Where this rank's last step went outside its compute."""
        self.peak_stashed_bytes = 0
        """The most bytes the 2BP engine kept for W at once in the last step."""
        self.wait_parameters: Callable[[int], None] | None = None
        """Called with a stage before each of its forwards (a sharded optimizer's gathers)."""
        self.residency: Residency | None = None
        """The sharded weights gathered and freed within each step (``shard_parameters=True``)."""

    def abandon_reductions(self) -> None:
        """Forget the reductions of a step that will not be completed (the pipeline closes)."""
        if self._reducer is not None:
            self._reducer.abandon()

    def _scattering(self, schedule: Schedule) -> frozenset[int]:
        """This rank's stages that reduce-scatter their gradients after each ``W``."""
        if self.residency is None or self.residency.scatter_each_w is False:
            return frozenset()
        return scattered_each_w_by_rank(schedule, self.residency.scatter_each_w)[self.pp_rank]

    def _run(
        self,
        schedule: Schedule,
        plan: CommPlan,
        batches: StepBatches,
    ) -> StepResult:
        clock = StepClock(self.device)
        dynamic = places_weights_at_run_time(schedule)
        channel = self._channel(schedule, plan, batches, dynamic)
        run = StepRun(
            self.rank,
            schedule.graph,
            self.stages,
            channel,
            batches.inputs,
            batches.targets,
            clock,
            self._weight_group_size,
            reducer=self._reducer,
            reductions_after_transfers=self._reductions_after_transfers,
            wait_parameters=self.wait_parameters,
            residency=self.residency,
            scattering=self._scattering(schedule),
            weights=batches.weights,
            dynamic_weights=dynamic,
        )
        try:
            if self.residency is not None:
                self.residency.gather_for_step()
            result = run.run(schedule.actions[self.pp_rank])
        except Exception as exc:
            self.failure = Failure(exc, run.current, time.time())
            if lost_peer(exc):
                self._abandon(channel)
                raise
            # Complete the step's transfers and reductions so that no peer waits on this rank.
            try:
                if channel is not None:
                    channel.drain()
                if self._reducer is not None:
                    run.drain(schedule.actions[self.pp_rank])
                    self._reducer.drain()
                    self._reducer.finish(keep=False)
                if self.residency is not None:
                    self.residency.release_all()
            except PeerError as lost:
                self._abandon(channel)
                raise lost from exc
            raise
        except BaseException:
            self._abandon(channel)
            raise
        if self._reducer is not None:
            waiting = clock.mark()
            self._reducer.finish()
            reductions = [s.action for s in result.spans if s.action.kind is Kind.REDUCE]
            if reductions:
                end = clock.seconds(clock.mark())
                result.waits.append(Span(self.rank, reductions[-1], clock.seconds(waiting), end))
        if self.residency is not None:
            self.residency.release_all()
        self.spans = result.spans
        self.waits = result.waits
        self.times = result.times
        self.peak_stashed_bytes = result.peak_stashed_bytes
        return result

    def _channel(
        self, schedule: Schedule, plan: CommPlan, batches: StepBatches, dynamic: bool
    ) -> StepChannel | None:
        """The step's remote transfers (None for a rank without peers)."""
        if not plan.peers:
            return None
        assert self._links is not None, "a pipeline rank with peers has links to them"
        return StepChannel(
            plan,
            self.topology,
            self._links,
            self.device,
            batches.layouts,
            self.timeout,
            schedule.n_stages,
            self.n_microbatches,
            batches.rows,
            order_only=self._order_only,
            # Gloo completes a receive only in a wait: the dynamic policy's
            # "has it arrived?" needs a thread waiting for it.
            watch_receives=dynamic and "nccl" not in (self.topology.members.backend or ""),
        )

    def _abandon(self, channel: StepChannel | None) -> None:
        """Give up the step's transfers and reductions: nobody is left to complete them with."""
        if channel is not None:
            channel.abandon()
        if self._reducer is not None:
            self._reducer.abandon()

    def run_step(
        self,
        schedule: Schedule,
        plan: CommPlan,
        batches: StepBatches,
        training: bool,
    ) -> tuple[StepResult, StepEnd]:
        """Run a step and settle it with every rank: the loss, or the failure.

        Returns:
            The step's result, and what every rank learnt at its end: the
            mean loss (None without targets), the first micro-batch whose
            loss is not finite and the rank that computed it (-1 and -1 if
            none), and the count that divides the gradients of a loss that
            returns ``(sum, count)``.

        Raises:
            Exception: on the rank where the step failed, its own error; on the
                others, :class:`PeerStepFailedError` naming it. A lost peer
                (``PeerError``) is raised at once: there is nobody to settle with.
        """
        failure: Exception | None = None
        result = StepResult()
        try:
            result = self._run(schedule, plan, batches)
        except Exception as exc:
            for stage in self.stages.values():
                stage.abandon_step()
            if lost_peer(exc) or self.topology.is_single:
                raise
            failure = exc
        except BaseException:
            for stage in self.stages.values():
                stage.abandon_step()
            raise
        else:
            if training:
                for stage in self.stages.values():
                    stage.finish_step()
        losses = result.losses if failure is None else None
        mine = None
        if failure is not None:
            recorded = self.failure
            known = recorded is not None and recorded.error is failure
            mine = recorded if known else Failure(failure, None, time.time())
        end = end_step(
            self.topology.members, self.device, self.timeout, losses, mine, batches.weights
        )
        if failure is not None or end.error is not None:
            if end.error is not None:
                raise end.error
            assert failure is not None
            raise failure
        return result, end
