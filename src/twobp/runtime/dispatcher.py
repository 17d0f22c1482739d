"""Run one rank's actions for one step: a table from action kind to handler.

The dispatcher holds no schedule logic: it runs the actions in the order the
schedule lists them. Each compute handler takes its input (a local hand-over
from another stage of this rank, or a receive), runs the stage, and hands its
output on (locally, or with a send posted at once). The compute part of every
action is timed (see :mod:`twobp.runtime.clock`); waiting for inputs is not,
so idle time shows as bubble.
Communication actions of a lowered schedule need no work: transfers follow
from the compute actions (see :mod:`twobp.runtime.comm_plan`). On the first
stage, an ``I`` directly followed by its own ``W`` runs as one ``B``
(:func:`fuse_first_stage_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from twobp.runtime.clock import StepClock
from twobp.runtime.comm import StepChannel
from twobp.runtime.comm_plan import Direction, Transfer, needed_transfer, produced_transfer
from twobp.runtime.microbatch import Batch, flatten
from twobp.runtime.stage import Stage
from twobp.schedule.action import Action, Kind
from twobp.timeline import Span


@dataclass
class StepResult:
    """What one rank's step produced.

    Args:
        spans: start and end of every compute action, in seconds from the step start.
        losses: the (detached) loss of each micro-batch, on the rank of the last stage.
        outputs: the last stage's output of each micro-batch (evaluation without targets).
        peak_stashed_bytes: the most bytes this rank's stages kept for W at once.
    """

    spans: list[Span] = field(default_factory=list)
    losses: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, tuple[tuple[Tensor, ...], bool]] = field(default_factory=dict)
    peak_stashed_bytes: int = 0


class StepRun:
    """One step of one rank.

    Args:
        rank: this rank.
        placement: the rank of each stage.
        stages: this rank's stages, by index.
        channel: the step's remote transfers; None if the rank has no peers.
        inputs: micro-batches of the model input (needed by the rank of stage 0).
        targets: micro-batches of the targets (rank of the last stage; None
            for evaluation without targets).
        clock: the step's clock, started at the step start.
        weight_group_size: passed to every ``W``.
    """

    def __init__(
        self,
        rank: int,
        placement: tuple[int, ...],
        stages: Mapping[int, Stage],
        channel: StepChannel | None,
        inputs: Sequence[Batch] | None,
        targets: Sequence[Batch] | None,
        clock: StepClock,
        weight_group_size: int | None = None,
    ) -> None:
        self._rank = rank
        self._placement = placement
        self._stages = stages
        self._channel = channel
        self._inputs = inputs
        self._targets = targets
        self._clock = clock
        self._marks: list[tuple[Action, Any, Any]] = []
        self._group_size = weight_group_size
        self._local: dict[tuple[Direction, int, int], tuple[tuple[Tensor, ...], bool]] = {}
        self.result = StepResult()

    def run(self, actions: Sequence[Action]) -> StepResult:
        """Run ``actions`` in order and complete the step's sends.

        Raises:
            Exception: whatever an action raised, with a note naming the rank,
                stage, action and micro-batch.
        """
        # A local table: one kept on the instance would be a reference cycle
        # (instance -> bound method -> instance) that keeps the step's channel,
        # and with it the process group, alive until the garbage collector runs.
        handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.FORWARD: self._forward,
            Kind.FULL_BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward,
            Kind.BACKWARD_WEIGHT: self._weight,
            Kind.SEND_F: self._nothing,
            Kind.RECV_F: self._nothing,
            Kind.SEND_B: self._nothing,
            Kind.RECV_B: self._nothing,
        }
        if self._channel is not None:
            self._channel.post_ahead()
        for action in fuse_first_stage_backward(actions, self._first_stages()):
            if self._channel is not None:
                self._channel.action = action
            try:
                handlers[action.kind](action)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(
                        f"(rank {self._rank}, stage {action.stage}, action {action}, "
                        f"micro-batch(es) {', '.join(map(str, action.microbatches))})"
                    )
                raise
        if self._channel is not None:
            self._channel.finish()
        self.result.spans = [
            Span(self._rank, a, self._clock.seconds(start), self._clock.seconds(end))
            for a, start, end in self._marks
        ]
        return self.result

    # -- handlers -----------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        stage, mb = self._stages[action.stage], action.microbatch
        if stage.is_first:
            assert self._inputs is not None, "the rank of stage 0 needs the inputs"
            inputs, is_tuple = flatten(self._inputs[mb], "the inputs")
        else:
            inputs, is_tuple = self._take(action)
        target = self._targets[mb] if stage.is_last and self._targets is not None else None
        start = self._clock.mark()
        outputs, out_is_tuple = stage.forward(mb, inputs, is_tuple, target)
        self._record(action, start)
        if stage.is_last:
            if target is not None:
                self.result.losses[mb] = outputs[0]
            else:
                self.result.outputs[mb] = (outputs, out_is_tuple)
            return
        self._give(action, outputs, out_is_tuple)

    def _backward(self, action: Action) -> None:
        stage, mb = self._stages[action.stage], action.microbatch
        grad_outputs = () if stage.is_last else self._take(action)[0]
        start = self._clock.mark()
        split = action.kind is Kind.BACKWARD_INPUT
        grads = stage.backward(mb, grad_outputs, split=split)
        self._record(action, start)
        if not stage.is_first:
            # First: another stage may be waiting for it.
            self._give(action, grads, False)
        if split:
            # The stash for W only grows at I: its peak follows one.
            held = sum(sum(s.gradients.stashed_bytes().values()) for s in self._stages.values())
            self.result.peak_stashed_bytes = max(self.result.peak_stashed_bytes, held)

    def _weight(self, action: Action) -> None:
        start = self._clock.mark()
        self._stages[action.stage].weight(action.microbatches, self._group_size)
        self._record(action, start)

    def _nothing(self, action: Action) -> None:
        return None

    def _first_stages(self) -> frozenset[int]:
        return frozenset(i for i, stage in self._stages.items() if stage.is_first)

    # -- hand-over between stages ---------------------------------------------------

    def _take(self, action: Action) -> tuple[tuple[Tensor, ...], bool]:
        transfer = needed_transfer(action, self._placement)
        assert transfer is not None
        if not transfer.is_local:
            assert self._channel is not None
            return self._channel.recv(transfer)
        tensors, is_tuple = self._local.pop(transfer.key)
        if transfer.direction is Direction.ACTIVATION:
            # A fresh leaf per stage, so each stage's backward stops at its inputs.
            tensors = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        return tensors, is_tuple

    def _give(self, action: Action, tensors: tuple[Tensor, ...], is_tuple: bool) -> None:
        transfer: Transfer | None = produced_transfer(action, self._placement)
        assert transfer is not None
        if transfer.is_local:
            self._local[transfer.key] = (tensors, is_tuple)
        else:
            assert self._channel is not None
            self._channel.send(transfer, tensors, is_tuple)

    def _record(self, action: Action, start: Any) -> None:
        self._marks.append((action, start, self._clock.mark()))


def fuse_first_stage_backward(
    actions: Sequence[Action], first_stages: frozenset[int]
) -> list[Action]:
    """The actions to run: on the first stage, ``I`` followed by its own ``W`` becomes ``B``.

    The first stage's input gradient goes nowhere, so splitting its backward
    gains nothing unless its ``W`` moves into a wait; when the schedule puts
    ``Wk`` right after ``Ik``, one full backward does the same work with the
    weight gradients computed while their operands are still in cache (the
    engine's ``backward_full``). Such a pair runs, and shows in the timeline,
    as one ``B``.

    Args:
        actions: one rank's actions, in order.
        first_stages: the stages among them that are the pipeline's first
            (at most stage 0).

    Returns:
        The actions, with each such pair replaced by a ``B``.
    """
    out: list[Action] = []
    skip = False
    for here, after in zip(actions, [*actions[1:], None], strict=True):
        if skip:
            skip = False
            continue
        if (
            after is not None
            and here.stage in first_stages
            and here.kind is Kind.BACKWARD_INPUT
            and after.kind is Kind.BACKWARD_WEIGHT
            and after.stage == here.stage
            and after.microbatches == here.microbatches
        ):
            out.append(Action(here.stage, Kind.FULL_BACKWARD, here.microbatches))
            skip = True
        else:
            out.append(here)
    return out
