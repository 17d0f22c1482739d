"""``resolve_schedule``: the name the preparation pass had before it was one pass.

:func:`resolve_schedule` is :func:`twobp.schedule.prepare.prepare` with the
arguments it always took; new code calls :func:`~twobp.schedule.prepare.prepare`.
This module imports no torch.
"""

from __future__ import annotations

import os

from twobp.schedule._timing import Costs
from twobp.schedule.prepare import DEFAULT_MICROBATCHES, ScheduleConfigError, prepare
from twobp.schedule.schedule import Schedule

__all__ = ["DEFAULT_MICROBATCHES", "ScheduleConfigError", "resolve_schedule"]


def resolve_schedule(
    schedule: str | os.PathLike[str] | Schedule,
    *,
    n_ranks: int,
    n_microbatches: int | None,
    two_bp: bool,
    policy: str = "paper",
    stages_per_rank: int | None = None,
    costs: Costs = None,
) -> Schedule:
    """The validated compute schedule a pipeline of ``n_ranks`` runs (:func:`prepare`).

    Raises:
        ScheduleConfigError: if the schedule or 2BP policy is unknown, the
            schedule does not fit the group or the micro-batch count, or
            cannot be merged.
        twobp.schedule.ScheduleError: if it is incomplete or deadlocks.
    """
    return prepare(
        schedule,
        n_ranks=n_ranks,
        n_microbatches=n_microbatches,
        two_bp=two_bp,
        policy=policy,
        stages_per_rank=stages_per_rank,
        costs=costs,
    )
