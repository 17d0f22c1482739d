"""Run one rank's actions for one step: a table from action kind to handler.

The dispatcher holds no schedule logic: it runs the actions of the lowered
schedule (:func:`twobp.schedule.add_communication`) in the order it lists
them. A compute handler takes its input from the step's hand-over table, runs
the stage and puts its output there; a ``RECV_*`` waits for a transfer from
another rank into that table, and a ``SEND_*`` posts the send of what the
action before it produced. Between stages of one rank the table is the
whole transfer. The compute part of every action is timed (see
:mod:`twobp.runtime.execution.clock`); waiting for inputs is not, so idle time shows as
bubble.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from twobp.models.tensor_parallel import while_reducing
from twobp.runtime.communication.channel import StepChannel
from twobp.runtime.communication.reduction import GradientReducer
from twobp.runtime.execution.clock import StepClock
from twobp.runtime.execution.dynamic_weights import EarlyReductions, WaitFiller
from twobp.runtime.execution.microbatch import Batch, flatten
from twobp.runtime.execution.residency import Residency, StepResidency
from twobp.runtime.execution.stage import Stage
from twobp.schedule.action import Action, Kind
from twobp.schedule.gradient_scatter import scatter_points, scatters_at_reduce
from twobp.schedule.kinds import ActionKind, Role
from twobp.schedule.schedule import StageGraph
from twobp.schedule.transfers import Direction, needed_transfer, produced_transfer, transfer_of
from twobp.sim.recompute import recomputes_derivatives
from twobp.timeline import Span


@dataclass
class StepTimes:
    """Where one rank's step went outside its compute, in host seconds.

    The time per send is what the simulator's
    :attr:`twobp.sim.CostModel.send_overhead` is measured from. On a GPU the
    host only queues kernels, so ``dispatch`` there is not the time between
    actions.

    Args:
        compute: the compute spans' total.
        dispatch: time in compute actions outside their compute span (taking
            and handing over tensors, bookkeeping), summed.
        sending: time posting sends to other ranks, summed.
        receiving: time in receives from other ranks: posting them and
            waiting for the peer, summed.
        compute_actions: compute actions run.
        sends: remote transfers sent.
        receives: remote transfers received.
        layout_messages: layout messages sent and read (see
            :mod:`twobp.runtime.communication.layout_cache`): none in a step
            whose input shapes the pipeline has seen before.
        weights_in_waits: parts of ``W`` (one layer's weight gradients each) run
            while a receive's data had not arrived (the ``dynamic`` 2BP policy).
        weight_seconds_in_waits: the compute time of those parts, summed.
        waited_with_weights_queued: time in receives from other ranks while this
            rank held ``W`` whose ``I`` had run (any policy): the wait ``W``
            could have filled.
        reducing: with tensor parallelism, the time from the start of each all-reduce of
            a column-parallel linear's input gradient (in ``I`` or ``B``) to its end,
            summed, the ``W`` run meanwhile included.
        weights_in_reductions: parts of ``W`` run while one of those all-reduces was in
            flight (the ``dynamic`` 2BP policy).
        weight_seconds_in_reductions: the compute time of those parts, summed.
    """

    compute: float = 0.0
    dispatch: float = 0.0
    sending: float = 0.0
    receiving: float = 0.0
    compute_actions: int = 0
    sends: int = 0
    receives: int = 0
    layout_messages: int = 0
    weights_in_waits: int = 0
    weight_seconds_in_waits: float = 0.0
    waited_with_weights_queued: float = 0.0
    reducing: float = 0.0
    weights_in_reductions: int = 0
    weight_seconds_in_reductions: float = 0.0


@dataclass
class StepResult:
    """What one rank's step produced.

    Args:
        spans: start and end of every compute action, in seconds from the step start.
        losses: the (detached) loss of each micro-batch, on the rank of the last
            stage: ``(mean,)``, or ``(sum, count)`` for a loss that returns both.
        outputs: the last stage's output of each micro-batch (evaluation without targets).
        peak_stashed_bytes: the most bytes this rank's stages kept for W at once.
        times: where the step went outside the compute.
        waits: every receive from another rank, from posting it until its tensors
            arrived (the time this rank waited on a peer), in seconds from the step start.
    """

    spans: list[Span] = field(default_factory=list)
    losses: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    outputs: dict[int, tuple[tuple[Tensor, ...], bool]] = field(default_factory=dict)
    peak_stashed_bytes: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    waits: list[Span] = field(default_factory=list)


class StepRun:
    """One step of one rank.

    Args:
        rank: this rank.
        graph: the rank of each stage and the pipelines they form (2 for Chimera).
        stages: this rank's stages, by index.
        channel: the step's remote transfers; None if the rank has no peers.
        inputs: micro-batches of the model input (needed by the rank of stage 0).
        targets: micro-batches of the targets (rank of the last stage; None
            for evaluation without targets).
        clock: the step's clock, started at the step start.
        weight_group_size: passed to every ``W``.
        reducer: starts the gradient reductions of ``R``; None: ``R`` does nothing.
        reductions_after_transfers: start the reductions of every ``R`` only
            once the step's transfers are complete, in the order of
            :func:`reduction_order` (on NCCL: see :func:`reductions_wait_for_transfers`).
        wait_parameters: called with a stage before each of its forwards: waits
            for the gathers of its updated parameters (a sharded optimizer).
        scattering: with ``residency``, the stages whose gradients are reduce-scattered
            after each ``W`` (agreed with their other holders:
            :func:`twobp.schedule.gradient_scatter.scattered_each_w_by_rank`).
        residency: frees each stage's sharded weights right after its last action of
            the step that reads them (``shard_parameters=True``, see
            :mod:`twobp.runtime.execution.residency`).
        weights: the weight of each micro-batch's loss (None: ``1 / n_microbatches``).
        dynamic_weights: run stored ``W`` in the waits for receives (the ``dynamic``
            2BP policy, :mod:`twobp.runtime.execution.dynamic_weights`).
    """

    def __init__(
        self,
        rank: int,
        graph: StageGraph,
        stages: Mapping[int, Stage],
        channel: StepChannel | None,
        inputs: Sequence[Batch] | None,
        targets: Sequence[Batch] | None,
        clock: StepClock,
        weight_group_size: int | None = None,
        *,
        reducer: GradientReducer | None = None,
        reductions_after_transfers: bool = False,
        wait_parameters: Callable[[int], None] | None = None,
        residency: Residency | None = None,
        scattering: frozenset[int] = frozenset(),
        weights: Sequence[float] | None = None,
        dynamic_weights: bool = False,
    ) -> None:
        self._rank = rank
        self._graph = graph
        self._stages = stages
        self._channel = channel
        self._inputs = inputs
        self._targets = targets
        self._clock = clock
        self._marks: list[tuple[Action, Any, Any]] = []
        self._waits: list[tuple[Action, Any, Any]] = []
        self._weight_group_size = weight_group_size
        self._reducer = reducer
        self._defer_reductions = reductions_after_transfers
        self._deferred: list[int] = []
        self._wait_parameters = wait_parameters
        self._residency = residency
        self._scattering = scattering
        self._weights = weights
        self._handed: dict[tuple[Direction, int, int], tuple[tuple[Tensor, ...], bool]] = {}
        self._dynamic = dynamic_weights
        self._filler: WaitFiller | None = None
        self._early: EarlyReductions | None = None
        self._scatter_at: dict[int, int] = {}
        """List positions after which a stage reduce-scatters its gradients (its ``W``)."""
        self._scatter_at_reduce: frozenset[int] | None = None
        """The stages whose ``R`` reduce-scatters their gradients (None: every one)."""
        self._position = 0
        self.result = StepResult()
        self.current: Action | None = None
        """The compute action being run (or served by the transfer being run)."""

    def run(self, actions: Sequence[Action]) -> StepResult:
        """Run ``actions`` in order and complete the step's sends.

        Raises:
            Exception: whatever an action raised, with a note naming the rank,
                stage, action and micro-batch.
        """
        # A local table: one kept on the instance would be a reference cycle
        # (instance -> bound method -> instance) that keeps the step's channel,
        # and with it the process group, alive until the garbage collector runs.
        handlers: dict[ActionKind, Callable[[Action], None]] = {
            Kind.FORWARD: self._forward,
            Kind.FULL_BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward,
            Kind.BACKWARD_WEIGHT: self._weight,
            Kind.BACKWARD_INPUT_REBUILT: self._backward,
            Kind.BACKWARD_WEIGHT_REBUILD: self._weight,
            Kind.SEND_F: self._send,
            Kind.RECV_F: self._receive,
            Kind.SEND_B: self._send,
            Kind.RECV_B: self._receive,
            Kind.REDUCE: self._reduce,
        }
        residency = self._begin(actions)
        for index, (action, served) in enumerate(
            zip(actions, compute_served(actions), strict=True)
        ):
            self.current = served
            self._position = index
            if self._channel is not None:
                self._channel.action = served
            receiving = None
            try:
                if action.kind.role is Role.RECEIVE:
                    self._fill_wait(action)
                    receiving = self._clock.mark()
                queued = receiving is not None and self._weights_queued()
                started = time.perf_counter()
                handler = handlers.get(action.kind)
                if handler is None:
                    raise ValueError(
                        f"no handler runs {action.kind} actions: the runtime runs the built-in "
                        f"kinds ({', '.join(map(str, handlers))}); take {action} out of the "
                        "schedule"
                    )
                before = self._stages[action.stage].memory.held
                handler(action)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(
                        f"(rank {self._rank}, stage {served.stage}, action {served}, "
                        f"micro-batch(es) {', '.join(map(str, served.microbatches))})"
                    )
                raise
            self._count(action, time.perf_counter() - started)
            if queued:
                self.result.times.waited_with_weights_queued += time.perf_counter() - started
            self._scatter_after(index)
            if residency is not None:
                residency.after(index, action, self._stages[action.stage].memory.held, before)
            if receiving is not None:
                self._waits.append((action, receiving, self._clock.mark()))
        return self._end()

    def _begin(self, actions: Sequence[Action]) -> StepResidency | None:
        """Start the step: memory meters, receives posted ahead; the step's residency of
        sharded weights (None without)."""
        if torch.is_grad_enabled():
            for meter in {id(s.memory): s.memory for s in self._stages.values()}.values():
                meter.start_step([s.module for s in self._stages.values()])
        if self._channel is not None:
            self._channel.post_ahead()
        if self._dynamic:
            eligible = frozenset(
                s for s, st in self._stages.items() if not recomputes_derivatives(st.recompute)
            )
            self._filler = WaitFiller(self._stages, self._weight_group_size, eligible, actions)
        if self._residency is None:
            if self._dynamic and self._reducer is not None:
                self._early = EarlyReductions(actions)
            return None
        if self._reducer is not None and not self._defer_reductions:
            self._scatter_at = scatter_points(actions, self._scattering)
            self._scatter_at_reduce = scatters_at_reduce(actions, self._scattering)
        if self._dynamic and self._reducer is not None and not self._scatter_at:
            # Not with reduce-scatters after W: an R started early could meet them in
            # another order on another copy.
            self._early = EarlyReductions(actions)
        rebuilds = lambda s: recomputes_derivatives(self._stages[s].recompute)  # noqa: E731
        return StepResidency(self._residency, actions, rebuilds)

    def _end(self) -> StepResult:
        """Complete the sends, start the deferred reductions, and sum up the step."""
        if self._channel is not None:
            self._channel.finish()
            self.result.times.layout_messages = self._channel.layout_messages
        if self._reducer is not None:
            for stage in reduction_order(self._deferred, self._graph):
                self._reducer.start(stage)
        self.result.spans = [
            Span(self._rank, a, self._clock.seconds(start), self._clock.seconds(end))
            for a, start, end in self._marks
        ]
        self.result.waits = [
            Span(self._rank, a, self._clock.seconds(start), self._clock.seconds(end))
            for a, start, end in self._waits
        ]
        times = self.result.times
        times.compute = sum(s.end - s.start for s in self.result.spans)
        times.dispatch = max(0.0, times.dispatch - times.compute)
        return self.result

    def _count(self, action: Action, seconds: float) -> None:
        """Add an action's host time to the step's :class:`StepTimes`.

        ``dispatch`` holds the compute actions' whole time until :meth:`run`
        takes their compute out.
        """
        times = self.result.times
        role = action.kind.role
        if action.kind.is_compute:
            times.dispatch += seconds
            times.compute_actions += 1
        elif role is Role.SEND:
            times.sending += seconds
            times.sends += 1
        elif role is Role.RECEIVE:
            times.receiving += seconds
            times.receives += 1

    # -- handlers -----------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        stage, mb = self._stages[action.stage], action.microbatch
        if self._wait_parameters is not None:
            self._wait_parameters(action.stage)
        if stage.is_first:
            assert self._inputs is not None, "the rank of stage 0 needs the inputs"
            inputs, is_tuple = flatten(self._inputs[mb], "the inputs")
        else:
            inputs, is_tuple = self._take(action)
        target = self._targets[mb] if stage.is_last and self._targets is not None else None
        weight = self._weights[mb] if self._weights is not None else None
        start = self._clock.mark()
        outputs, out_is_tuple = stage.forward(mb, inputs, is_tuple, target, weight)
        self._record(action, start)
        if stage.is_last:
            if target is not None:
                self.result.losses[mb] = outputs
            else:
                self.result.outputs[mb] = (outputs, out_is_tuple)
            return
        self._give(action, outputs, out_is_tuple)

    def _backward(self, action: Action) -> None:
        stage, mb = self._stages[action.stage], action.microbatch
        grad_outputs = () if stage.is_last else self._take(action)[0]
        start = self._clock.mark()
        rebuilt = action.kind is Kind.BACKWARD_INPUT_REBUILT
        split = rebuilt or action.kind is Kind.BACKWARD_INPUT
        with while_reducing(self._fill_reduction):
            grads = stage.backward(mb, grad_outputs, split=split, keep_stash=not rebuilt)
        self._record(action, start)
        if not stage.is_first:
            # First: another stage may be waiting for it.
            self._give(action, grads, False)
        if split:
            if self._filler is not None:
                self._filler.stored(action)
            # The stash for W only grows at I: its peak follows one.
            held = sum(sum(s.gradients.stashed_bytes().values()) for s in self._stages.values())
            self.result.peak_stashed_bytes = max(self.result.peak_stashed_bytes, held)

    def _weight(self, action: Action) -> None:
        mbs = action.microbatches
        if self._filler is not None:
            start = self._clock.mark()
            mbs, finished = self._filler.take(action)
            if finished is not None:
                # The rest of a W that waits part-ran.
                self._record(finished, start)
                self._start_early_reductions()
        if not mbs:
            return
        start = self._clock.mark()
        rebuild = action.kind is Kind.BACKWARD_WEIGHT_REBUILD
        self._stages[action.stage].weight(mbs, self._weight_group_size, rebuild=rebuild)
        ran = action if mbs == action.microbatches else Action.make(action.stage, action.kind, mbs)
        self._record(ran, start)

    def _fill_wait(self, action: Action) -> None:
        """Before the receive ``action`` blocks: run stored ``W`` a part at a time until
        its data has arrived or no ``W`` is left (the ``dynamic`` policy)."""
        channel = self._channel
        if self._filler is None or channel is None:
            return
        transfer = transfer_of(action, self._graph)
        parts, seconds = self._fill(lambda: channel.arrived(transfer), f"the {transfer}", True)
        times = self.result.times
        times.weights_in_waits += parts
        times.weight_seconds_in_waits += seconds
        times.dispatch += seconds  # as a compute action's whole time: its span is compute

    def _fill_reduction(self, work: Any) -> None:
        """While a tensor-parallel all-reduce of the backward running now is in flight: run
        stored ``W`` a part at a time until it completes or no ``W`` is left (the ``dynamic``
        policy; the parts show inside the backward's span), then wait for it."""
        begun = time.perf_counter()
        parts, seconds = self._fill(work.is_completed, "a tensor-parallel all-reduce", False)
        times = self.result.times
        times.weights_in_reductions += parts
        times.weight_seconds_in_reductions += seconds
        work.wait()
        times.reducing += time.perf_counter() - begun

    def _fill(self, done: Callable[[], bool], what: str, spans: bool) -> tuple[int, float]:
        """Run stored ``W`` a part at a time until ``done()`` or no ``W`` is left, each
        part's span recorded with ``spans``: how many parts ran, and their host seconds."""
        filler, parts, seconds = self._filler, 0, 0.0
        while filler is not None and filler.has_work and not done():
            start, host = self._clock.mark(), time.perf_counter()
            try:
                weight, finished = filler.run_part()
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"(in a W run while waiting for {what})")
                raise
            end = self._clock.mark()
            if spans:
                self._marks.append((weight, start, end))
            # On a GPU the host only queues the part: it waits for it, so that it asks
            # again whether it is done once the part ran, not before.
            self._clock.reach(end)
            parts, seconds = parts + 1, seconds + time.perf_counter() - host
            if finished:
                self._start_early_reductions()
        return parts, seconds

    def _weights_queued(self) -> bool:
        """Whether a stage of this rank holds a ``W`` whose ``I`` has run."""
        return any(stage.gradients.pending_weight() for stage in self._stages.values())

    def _start_early_reductions(self) -> None:
        """Start the ``R`` whose stages' ``W`` the waits have all run (in list order)."""
        if self._early is None or self._filler is None:
            return
        for stage in self._early.ready(self._position, self._filler.done):
            if self._defer_reductions:
                self._deferred.append(stage)
            elif self._reducer is not None:
                self._reducer.start(stage)

    def _reduce(self, action: Action) -> None:
        # Started here, in the background; the step waits for it at its end.
        if self._early is not None and self._position in self._early.started:
            return  # started once the waits ran its W
        start = self._clock.mark()
        if self._reducer is not None and self._defer_reductions:
            self._deferred.append(action.stage)
        elif self._reducer is not None:
            scattered = self._scatter_at_reduce
            gradients = scattered is None or action.stage in scattered
            self._reducer.start(action.stage, gradients=gradients)
        self._record(action, start)

    def drain(self, actions: Sequence[Action]) -> None:
        """After a failure: start the reduce-scatters after ``W`` and the ``R`` this step
        has not started, in list order, as the other copies meet them (the gradients are
        discarded), so that no peer waits for this rank in a collective."""
        reducer = self._reducer
        if reducer is None or not self._scatter_at:
            return
        for index, action in enumerate(actions):
            if index in self._scatter_at:
                reducer.scatter_now(self._scatter_at.pop(index))
            elif action.kind is Kind.REDUCE and action.stage not in reducer.started:
                scattered = self._scatter_at_reduce
                gradients = scattered is None or action.stage in scattered
                reducer.start(action.stage, gradients=gradients)

    def _scatter_after(self, index: int) -> None:
        """After action ``index``: reduce-scatter its stage's gradients if it is a ``W``
        of a stage that does so after each ``W``; let go of those already sent (an
        ``R``'s too), with sharded parameters."""
        if self._residency is None or self._reducer is None:
            return
        stage = self._scatter_at.pop(index, None)
        if stage is not None:
            nbytes = self._reducer.scatter_now(stage)
            if self._residency is not None:
                self._residency.scattered(nbytes)
        self._reducer.reap()
        self._residency.in_flight(self._reducer.scattering_bytes)

    def _send(self, action: Action) -> None:
        transfer = transfer_of(action, self._graph)
        assert self._channel is not None, "a send in a world of one"
        tensors, is_tuple = self._handed.pop(transfer.key)
        self._channel.send(transfer, tensors, is_tuple)

    def _receive(self, action: Action) -> None:
        transfer = transfer_of(action, self._graph)
        assert self._channel is not None, "a receive in a world of one"
        self._handed[transfer.key] = self._channel.recv(transfer)

    # -- hand-over between actions --------------------------------------------------

    def _take(self, action: Action) -> tuple[tuple[Tensor, ...], bool]:
        transfer = needed_transfer(action, self._graph)
        assert transfer is not None
        tensors, is_tuple = self._handed.pop(transfer.key)
        if transfer.is_local and transfer.direction is Direction.ACTIVATION:
            # A fresh leaf per stage, so each stage's backward stops at its inputs.
            tensors = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        return tensors, is_tuple

    def _give(self, action: Action, tensors: tuple[Tensor, ...], is_tuple: bool) -> None:
        transfer = produced_transfer(action, self._graph)
        assert transfer is not None
        self._handed[transfer.key] = (tensors, is_tuple)

    def _record(self, action: Action, start: Any) -> None:
        self._marks.append((action, start, self._clock.mark()))


REDUCE_AFTER_TRANSFERS_VARIABLE = "TWOBP_REDUCE_AFTER_TRANSFERS"
"""Environment variable: ``1`` defers every ``R`` to the end of the step's transfers on any
backend, as on NCCL (for the tests, which run gloo), as the pipeline option
``reduce_after_transfers`` does. Read once, when a pipeline is built
(:func:`reductions_wait_for_transfers`)."""


def reductions_wait_for_transfers(backend: str | None, requested: bool = False) -> bool:
    """Whether a step's reductions wait until its point-to-point transfers are complete.

    On NCCL they do: an all-reduce of ``R`` and a transfer in flight at the
    same time run on two communicators, whose kernels CUDA does not promise
    to run side by side, and two ranks that meet them in opposite orders can
    wait on each other for ever (see docs/reliability.md). After its
    transfers, a rank has only reductions in flight, started in one order on
    every rank (:func:`reduction_order`). Gloo progresses every operation on
    threads of its own: there ``R`` starts at once, overlapping the step's
    remaining work. ``requested`` (the pipeline option ``reduce_after_transfers``) or
    :data:`REDUCE_AFTER_TRANSFERS_VARIABLE` set to ``1`` now forces the NCCL rule.
    """
    if requested or os.environ.get(REDUCE_AFTER_TRANSFERS_VARIABLE, "") == "1":
        return True
    return backend is not None and "nccl" in backend


def reduction_order(stages: Sequence[int], graph: StageGraph) -> list[int]:
    """``stages`` in the order every rank starts their deferred reductions: by model stage.

    Every rank that reduces two model stages with another (Chimera's
    replicas, which run them in different orders) starts them in the same
    order; stages of one model stage keep their schedule order.
    """
    length = graph.n_stages // graph.n_pipelines
    return sorted(stages, key=lambda s: s % length)


def compute_served(actions: Sequence[Action]) -> list[Action]:
    """For each action, the compute action it serves (what errors and waits are named by).

    A compute action serves itself, a receive the compute action after it (which
    needs what it receives), a send the compute action before it (which made
    what it sends).
    """
    served: list[Action] = list(actions)
    last: Action | None = None
    for i, action in enumerate(actions):
        if action.kind.is_compute:
            last = action
        elif action.kind.role is Role.SEND and last is not None:
            served[i] = last
    following: Action | None = None
    for i in range(len(actions) - 1, -1, -1):
        if actions[i].kind.is_compute:
            following = actions[i]
        elif actions[i].kind.role is Role.RECEIVE and following is not None:
            served[i] = following
    return served
