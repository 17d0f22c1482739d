"""Steps a run skipped, as ``twobp train`` tells of them (pure).

Two things skip a step on every rank: a float16 overflow of the gradients,
which the loss scaler finds (the optimizer does not step; a dynamic scale
halves), and, with ``--nonfinite skip``, a loss that is not finite (the
step's gradients are dropped). The report lists the steps; the console hears
of them as they happen (:class:`SkipNotes`): a warning at the first step
skipped for each reason, then one line every ``--log-every`` steps skipped
for it, so that a run that skips every step does not flood the console. The
closing line counts them (:func:`skipped_text`), and a run that skipped
every one of its steps updated no weight: it fails (:func:`every_step_skipped`).
"""

from __future__ import annotations

from typing import Any

OVERFLOW = "float16 overflow"
NONFINITE = "non-finite loss"


class SkipNotes:
    """Which skipped steps the console hears of, and the line for each.

    Args:
        total: the step the run ends at (lines say ``step 3/10`` as the progress does).
        every: steps skipped for one reason between its lines, after the first's warning.
    """

    def __init__(self, total: int, every: int) -> None:
        self.total = total
        self.every = max(1, every)
        self.counts: dict[str, int] = {}

    def overflow(self, step: int, used: float, now: float, static: bool) -> str | None:
        """The line after ``step`` (steps done) was skipped for an overflow, if any.

        Args:
            step: the steps done, the skipped one included.
            used: the loss scale the step ran with.
            now: the loss scale after it (a dynamic scale halves).
            static: whether the scale never moves.
        """
        scale = f"{used:g} (static)" if static else f"{used:g} (dynamic, now {now:g})"
        what = f"the gradients overflowed float16 at loss scale {scale}; no weight was updated"
        return self._note(step, OVERFLOW, what)

    def nonfinite(self, step: int, loss: float) -> str | None:
        """The line after ``step`` (steps done) was skipped for a loss of ``loss``, if any."""
        return self._note(
            step, NONFINITE, f"the loss is {loss} (--nonfinite skip); its gradients were dropped"
        )

    def _note(self, step: int, reason: str, first: str) -> str | None:
        count = self.counts[reason] = self.counts.get(reason, 0) + 1
        if count == 1:
            return f"warning: step {step}/{self.total} skipped: {first}"
        if count % self.every == 0:
            return f"step {step}/{self.total}: {count} steps skipped so far ({reason})"
        return None


def skipped_counts(summary: dict[str, Any]) -> dict[str, int]:
    """The steps of this run (not of the run it resumed) skipped for each reason, if any.

    Args:
        summary: the run's summary (:func:`twobp.train.report.summarize`).
    """
    since = summary["resumed_from_step"] or 0
    counts = {
        OVERFLOW: sum(1 for s in summary["overflow_steps"] if s >= since),
        NONFINITE: sum(1 for s in summary["skipped_steps"] if s >= since),
    }
    return {reason: n for reason, n in counts.items() if n}


def skipped_text(summary: dict[str, Any]) -> str | None:
    """``"10 of 10 steps skipped (float16 overflow)"`` for this run's steps; None if none."""
    counts = skipped_counts(summary)
    if not counts:
        return None
    steps = summary["steps_this_run"]
    if len(counts) == 1:
        ((reason, n),) = counts.items()
        return f"{n} of {steps} steps skipped ({reason})"
    parts = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return f"{sum(counts.values())} of {steps} steps skipped ({parts})"


def every_step_skipped(summary: dict[str, Any]) -> str | None:
    """The error of a run that skipped every one of its steps (no weight updated), else None.

    It names the loss scale and what to change.
    """
    counts = skipped_counts(summary)
    steps = summary["steps_this_run"]
    if not steps or sum(counts.values()) < steps:
        return None
    why = []
    if OVERFLOW in counts:
        scale = summary["loss_scale_state"]["scale"]
        if summary["loss_scale"] == "static":
            why.append(
                f"the gradients overflowed float16 at the static loss scale {scale:g}: give a "
                "smaller --loss-scale (65536, say) or --loss-scale dynamic, which lowers the "
                "scale at every overflow"
            )
        else:
            why.append(
                "the gradients overflowed float16 at every dynamic loss scale, down to "
                f"{scale:g}: run more --steps for it to fall further, or give a static "
                f"--loss-scale below {scale:g}"
            )
    if NONFINITE in counts:
        why.append(
            "the loss was not finite: the weights are probably broken; resume from an earlier "
            "checkpoint with a lower --lr (or more --warmup, --grad-clip)"
        )
    reasons = ", ".join(
        f"{n} {reason}" if len(counts) > 1 else reason for reason, n in counts.items()
    )
    return (
        f"all {steps} steps of the run were skipped ({reasons}), no weight was updated; "
        + "; ".join(why)
    )
