"""The end of a step, the same on every rank: the loss, or who failed, where and why.

Every step ends with one small sum over the ranks (an all-reduce, or between two gloo
ranks a point-to-point exchange: :func:`twobp.runtime.communication.collective.sum_small`;
it replaces the broadcast of the loss): the weighted sum of the micro-batch losses and
the sum of their weights from the ranks of the last stages (one per pipeline and per
data-parallel copy), or, for a loss that returns ``(sum, count)``, the sums and the counts,
so that every rank gets the mean over the global batch (and the count that
divides the gradients of such a loss), the first micro-batch whose loss is not
finite, and each rank's status (0 fine, 1 failed by its own
error, 2 failed because a peer did). Only when some rank failed do the ranks
also exchange what went wrong; the earliest failure is the cause, since a
peer may fail in turn on the zeros a failed rank sent in place of its tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from twobp.runtime.base.group import Membership
from twobp.runtime.communication import collective
from twobp.runtime.errors import PeerError, PeerStepFailedError, PipelineConfigError
from twobp.schedule.action import Action

OWN_ERROR = 1
"""Status of a rank whose step failed by its own error."""
PEER_FAILED = 2
"""Status of a rank whose step failed because a peer's did."""


def lost_peer(exc: BaseException) -> bool:
    """True if ``exc`` says a peer is gone or stuck (no rank left to settle the step with)."""
    return isinstance(exc, PeerError) and not isinstance(exc, PeerStepFailedError)


@dataclass(frozen=True)
class Failure:
    """This rank's failed step.

    Args:
        error: what it raised.
        action: the compute action it was at (or that the transfer it was at served).
        when: the wall-clock time of the failure (seconds since the epoch).
    """

    error: Exception
    action: Action | None
    when: float

    def describe(self) -> str:
        """Where and how the step failed, for the peers' errors."""
        where = ""
        if self.action is not None:
            mbs = ", ".join(map(str, self.action.microbatches))
            where = f" at {self.action} (stage {self.action.stage}, micro-batch(es) {mbs})"
        text = str(self.error).splitlines()[0] if str(self.error) else ""
        return f"failed{where}: {type(self.error).__name__}: {text}"


@dataclass(frozen=True)
class StepEnd:
    """What every rank learnt at the end of a step.

    Args:
        loss: the mean loss over the micro-batches (None: no targets).
        first_bad: the first micro-batch whose loss is not finite (-1: none).
        bad_rank: the rank whose loss of ``first_bad`` was not finite (-1: none).
        error: for this rank, the error that says another rank failed the
            step; None if the step went through or this rank's own error is
            the cause.
        count: for a loss that returns ``(sum, count)``, the count over the
            global batch, by which the step's gradients are divided; None
            for a mean loss (weighted at the start of each backward).
    """

    loss: float | None
    first_bad: int
    error: PeerStepFailedError | None
    bad_rank: int = -1
    count: float | None = None


def end_step(
    members: Membership,
    device: torch.device,
    timeout: float,
    losses: Mapping[int, Tensor | tuple[Tensor, ...]] | None,
    failure: Failure | None,
    weights: Sequence[float] | None = None,
) -> StepEnd:
    """Settle a step with every rank. Collective: every rank calls it, failed or not.

    Args:
        members: the group.
        device: where the all-reduce runs.
        timeout: seconds to wait for the other ranks.
        losses: the losses of the micro-batches whose last stage ran here,
            by micro-batch, when the step went through: a mean, ``(mean,)``
            or ``(sum, count)``; None or empty elsewhere.
        failure: this rank's failure, or None.
        weights: the weight of each micro-batch's mean loss (None: 1 each).

    Returns:
        The loss and, when some rank failed, this rank's error.

    Raises:
        PipelineConfigError: on every rank, if some micro-batches' losses
            returned a mean and others ``(sum, count)``.
    """
    n = members.size
    # [weights or counts, weighted losses or sums, micro-batches of each kind (mean,
    # sum and count), first bad + 1 of each rank, status of each rank]
    head = 4
    status = torch.zeros(head + 2 * n, dtype=torch.float64, device=device)
    if failure is None and losses:
        order = sorted(losses)
        parts = [_parts(losses[m], None if weights is None else weights[m]) for m in order]
        stacked = torch.stack([value for value, _, _ in parts])
        bad = (~torch.isfinite(stacked)).nonzero()
        status[0] = sum(float(w) for _, w, _ in parts)
        status[1] = stacked.sum()
        status[2] = sum(1 for *_, pair in parts if not pair)
        status[3] = sum(1 for *_, pair in parts if pair)
        status[head + members.rank] = float(order[int(bad[0, 0])]) + 1 if len(bad) else 0.0
    if failure is not None:
        own = not isinstance(failure.error, PeerStepFailedError)
        status[head + n + members.rank] = OWN_ERROR if own else PEER_FAILED
    collective.sum_small(members, status, timeout, "the end of the step")
    values = status.tolist()
    loss = values[1] / values[0] if values[0] else (math.nan if values[3] else None)
    codes = [int(v) for v in values[head + n :]]
    if not any(codes):
        if values[2] and values[3]:
            raise PipelineConfigError(
                f"rank {members.rank}: loss_fn returned a mean for {int(values[2])} "
                f"micro-batches and (sum, count) for {int(values[3])}; return one or the "
                "other for every micro-batch"
            )
        nonfinite = [(int(v) - 1, r) for r, v in enumerate(values[head : head + n]) if v]
        first_bad, bad_rank = min(nonfinite, default=(-1, -1))
        count = values[0] if values[3] else None
        return StepEnd(loss, first_bad, None, bad_rank, count)
    mine = None
    if failure is not None and codes[members.rank] == OWN_ERROR:
        mine = (failure.when, failure.describe())
    reports = collective.all_gather_objects(members, mine)
    when = {r: report[0] for r, report in enumerate(reports) if report is not None}
    first = min(when, key=lambda r: (when[r], r)) if when else codes.index(PEER_FAILED)
    if first == members.rank:
        return StepEnd(loss, -1, None)
    report = reports[first][1] if reports[first] is not None else "failed"
    after = f" (then this rank {mine[1]})" if mine is not None else ""
    error = PeerStepFailedError(
        f"rank {members.rank}: rank {first} {report}{after}. The step was dropped on every "
        "rank (no gradients were kept); the pipeline can run the next step",
        members.rank,
        first,
    )
    return StepEnd(loss, -1, error)


def _parts(loss: Tensor | tuple[Tensor, ...], weight: float | None) -> tuple[Tensor, Tensor, bool]:
    """A micro-batch's part of the step's loss: what it adds to the numerator and to
    the denominator, and whether it is a ``(sum, count)``."""
    if isinstance(loss, Tensor):
        loss = (loss,)
    if len(loss) == 2:
        return loss[0].double().reshape(()), loss[1].double().reshape(()), True
    w = 1.0 if weight is None else weight
    return loss[0].double().reshape(()) * w, torch.tensor(w, dtype=torch.float64), False
