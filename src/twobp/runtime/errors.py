"""Errors of the distributed runtime.

Every error says where it happened (rank, stage, action, micro-batch, peer)
and what to change. They share the base :class:`PipelineError`, so a caller
can catch all runtime failures at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PipelineError(RuntimeError):
    """Base class of the errors raised by the pipeline runtime."""


class PipelineClosedError(PipelineError):
    """The pipeline was closed, or the process group it runs in was destroyed.

    Nothing of the pipeline can run any more; build a new one.
    """


class PipelineConfigError(PipelineError, ValueError):
    """The pipeline cannot be built as asked (schedule, partition, batch, world size)."""


class PeerError(PipelineError):
    """Communication with another rank failed.

    Args:
        message: the full text of the error.
        rank: this rank.
        peer: the rank this one was talking to; None for a collective, where
            any rank may be the one missing.
    """

    def __init__(self, message: str, rank: int, peer: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


class PeerTimeoutError(PeerError):
    """A rank waited on a peer for longer than the pipeline's ``timeout``."""


class PeerFailedError(PeerError):
    """A peer closed the connection or failed while this rank was waiting on it."""


class PeerStepFailedError(PeerFailedError):
    """Another rank failed during this step and told this one (the step was dropped).

    Every rank of the step raises at the step's end: the rank that failed its
    own error, the others this one, naming the failed rank, its action and
    micro-batch and its error. The pipeline stays usable for the next step.
    """


class ShapeMismatchError(PipelineError):
    """A tensor sent between two stages differs from the layout its input shapes passed before.

    The runtime learns each boundary's layout once per signature of the step's
    input shapes (:mod:`twobp.runtime.communication.layout_cache`) and allocates
    the receive buffers from it: a block's output shape may follow its input's
    shape but not its values.
    """


class NonFiniteLossError(PipelineError, ArithmeticError):
    """The mean loss of a step is NaN or infinite (with ``nonfinite="raise"``).

    Every rank raises it, after the step's gradients were dropped, so the
    pipeline can go on (for example after lowering the learning rate).

    Args:
        message: the full text of the error.
        step: the index of the step (0 for the first step of the pipeline).
        loss: the mean loss that was not finite.
    """

    def __init__(self, message: str, step: int, loss: float) -> None:
        super().__init__(message)
        self.step = step
        self.loss = loss

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.step, self.loss))


class CheckpointError(PipelineError):
    """A checkpoint cannot be written, found or loaded into this pipeline."""


class ModelMismatchError(PipelineConfigError):
    """The ranks built different models or were given different pipeline options."""


@dataclass(frozen=True)
class RankFailure:
    """How one process of a :func:`twobp.runtime.launch` group ended badly.

    Args:
        rank: the rank of the process.
        exitcode: its exit code (negative: killed by that signal; None: never exited).
        error_type: the exception class name, when the process reported one.
        message: the exception message, or a description of the signal.
        traceback: the formatted traceback, when the process reported one.
        when: wall-clock time (``time.time()``) of the failure, when known.
        peer: for a peer error, the rank this one was waiting on (None for a
            collective or another error).
        stack: where the process was when the launcher terminated it (the
            innermost frames), when it was terminated.
        stuck: True if the process was terminated while others waited on it
            in vain: it is the cause of their time-outs.
    """

    rank: int
    exitcode: int | None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    when: float | None = None
    peer: int | None = None
    stack: str = ""
    stuck: bool = False

    def summary(self) -> str:
        """One line: ``rank 1: ValueError: bad input`` or ``rank 2: killed by SIGKILL``.

        A terminated process adds the innermost frame of where it was.
        """
        if self.error_type:
            return f"rank {self.rank}: {self.error_type}: {self.message}"
        text = f"rank {self.rank}: {self.message or f'exit code {self.exitcode}'}"
        where = last_frame(self.stack)
        return f"{text}; it was at {where}" if where else text


def last_frame(stack: str) -> str:
    """The innermost ``File "...", line N, in f`` of a Python stack dump, shortened.

    ``faulthandler`` lists the innermost frame first, after the line that
    names the thread; a traceback lists it last. Both are read here.
    """
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return ""
    innermost = frames[0] if "most recent call first" in stack else frames[-1]
    return innermost.removeprefix("File ")


class LaunchError(PipelineError):
    """One or more processes of a local launch failed.

    Its message is one line per failed rank, the cause first; each rank printed
    its traceback on its own stderr when it failed, and :attr:`details` holds
    them all (``twobp train`` writes them to ``OUT/errors.log``).

    Args:
        failures: the ranks that failed, the first to fail first.
        nprocs: how many processes were started.
        message: the whole message instead of one line per failure (a launch
            that could not start its ranks at all).
    """

    def __init__(
        self, failures: Sequence[RankFailure], nprocs: int, message: str | None = None
    ) -> None:
        self.failures = tuple(failures)
        self.nprocs = nprocs
        self.details = "\n\n".join(
            f"{f.summary()}\n{(f.traceback or f.stack or '(no traceback)').rstrip()}"
            for f in self.failures
        )
        """Every failed rank's summary with its traceback (or, terminated, its stack)."""
        if message is not None:
            super().__init__(message)
            return
        lines = [f"{len(self.failures)} of {nprocs} processes failed"]
        if self.failures:
            cause = self.failures[0]
            if cause.stuck:
                lines[0] += f"; rank {cause.rank} was stuck (the others timed out waiting on it)"
            else:
                lines[0] += f"; the first was rank {cause.rank}"
        lines += ["  " + f.summary() for f in self.failures]
        super().__init__("\n".join(lines))


def nonfinite_error(
    world_rank: int, step: int, loss: float, microbatch: int, rank: int
) -> NonFiniteLossError:
    """The error for a step whose mean loss is not finite.

    Args:
        world_rank: this rank.
        step: the step index.
        loss: the mean loss.
        microbatch: the first micro-batch whose loss was not finite (-1: unknown).
        rank: the rank of a last stage that computed that micro-batch's loss
            (-1: unknown).
    """
    first = f"; micro-batch {microbatch} was the first" if microbatch >= 0 else ""
    where = f"computed on rank {rank}, a last stage" if rank >= 0 else "computed on a last stage"
    return NonFiniteLossError(
        f"rank {world_rank}: the mean loss of step {step + 1} (step_count {step}) is {loss} "
        f"({where}"
        f"{first}). The step's gradients were dropped on every rank. Lower the "
        "learning rate, clip gradients, check the data and the loss for division by zero or "
        "log(0), use a wider dtype, or pass nonfinite='skip' to skip such steps",
        step,
        loss,
    )


class NonRepeatableForwardError(PipelineConfigError):
    """A stage's forward, run again for recomputation, changed the block's buffers.

    Recomputation (``Pipeline(recompute=...)``) needs a forward that gives the
    same result when run twice on the same input: one that updates buffers
    (BatchNorm's running statistics in training mode) or reads a changing
    global is not. The message names the rank, stage, micro-batch, block and
    buffers; run that stage without recomputation.
    """
