"""Turn the ``schedule`` argument of a pipeline into the schedule it runs.

A schedule may be given as a registered name, a :class:`Schedule` or a CSV
file. It is then made to match the pipeline's ``two_bp`` choice: a fused
schedule is split by :func:`apply_two_bp` (with the chosen policy), a
natively split one (``zb-*``) keeps its ``I``/``W``, and with ``two_bp=False``
a split one is merged back into ``B`` by :func:`merge_backward`.
Communication actions are dropped: :func:`add_communication` places them
again on the schedule that runs.

This module imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from twobp.schedule._timing import Costs
from twobp.schedule.csv_io import load_csv
from twobp.schedule.lowering import (
    add_reductions,
    compute_only,
    has_reductions,
    is_split,
    merge_backward,
)
from twobp.schedule.registry import SCHEDULES, generate
from twobp.schedule.schedule import Schedule
from twobp.schedule.two_bp import TWO_BP_POLICIES, apply_two_bp
from twobp.schedule.validate import validate

DEFAULT_MICROBATCHES = 8
"""Micro-batches per step when a schedule is given by name without a count."""


class ScheduleConfigError(ValueError):
    """A schedule argument that cannot be resolved: unknown, or not fitting the group."""


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
    """The validated compute-only schedule a pipeline of ``n_ranks`` runs.

    Args:
        schedule: a name of :data:`twobp.schedule.SCHEDULES`, a CSV path, or a
            :class:`Schedule`.
        n_ranks: ranks in the group; the schedule must use exactly these.
        n_microbatches: micro-batches per step; None takes the schedule's own
            (or :data:`DEFAULT_MICROBATCHES` for a name).
        two_bp: split fused backwards (True) or merge split ones (False).
        policy: the 2BP policy for :func:`apply_two_bp`.
        stages_per_rank: for a name, stages per rank (None: the schedule's default).
        costs: the cost model by which ``paper`` and ``fill`` place ``W``
            (see :func:`apply_two_bp`); None: unit times.

    Returns:
        The schedule to run.

    Raises:
        ScheduleConfigError: if the schedule or 2BP policy is unknown, the
            schedule does not fit the group or the micro-batch count, or
            cannot be merged.
        twobp.schedule.ScheduleError: if it is incomplete or deadlocks.
    """
    if policy not in TWO_BP_POLICIES:
        raise ScheduleConfigError(
            f"unknown 2BP policy {policy!r}; use one of {', '.join(TWO_BP_POLICIES)} "
            "(two_bp_policy= of the Pipeline, --policy of twobp train)"
        )
    if n_microbatches is not None and n_microbatches < 1:
        raise ScheduleConfigError(f"n_microbatches must be at least 1, got {n_microbatches}")
    if isinstance(schedule, Schedule):
        resolved = schedule
        if n_microbatches is not None and n_microbatches != schedule.n_microbatches:
            raise ScheduleConfigError(
                f"n_microbatches={n_microbatches} but the schedule "
                f"{schedule.name or ''} covers {schedule.n_microbatches}; leave n_microbatches "
                "unset or make them agree"
            )
    elif isinstance(schedule, str) and schedule in SCHEDULES:
        m = DEFAULT_MICROBATCHES if n_microbatches is None else n_microbatches
        try:
            resolved = generate(schedule, n_ranks, m, stages_per_rank=stages_per_rank)
        except ValueError as exc:
            raise ScheduleConfigError(f"cannot build schedule {schedule!r}: {exc}") from exc
    elif Path(schedule).suffix.lower() == ".csv" or Path(schedule).is_file():
        if not Path(schedule).is_file():
            raise ScheduleConfigError(f"schedule file {os.fspath(schedule)!r} does not exist")
        resolved = load_csv(os.fspath(schedule))
        if n_microbatches is not None and n_microbatches != resolved.n_microbatches:
            raise ScheduleConfigError(
                f"n_microbatches={n_microbatches} but {os.fspath(schedule)!r} covers "
                f"{resolved.n_microbatches} micro-batches"
            )
    else:
        raise ScheduleConfigError(
            f"unknown schedule {schedule!r}: give one of {', '.join(SCHEDULES)}, "
            "a Schedule object or the path of a CSV file"
        )
    if resolved.n_ranks != n_ranks:
        raise ScheduleConfigError(
            f"schedule {resolved.name or ''} places its stages on {resolved.n_ranks} ranks, "
            f"but the group has {n_ranks}; start {resolved.n_ranks} processes or use a "
            f"schedule for {n_ranks}"
        )
    resolved = compute_only(resolved)
    validate(resolved)
    # Reductions follow the last W of their stage: placed again, on every stage, once W is.
    reduces = resolved.n_pipelines > 1 or has_reductions(resolved)
    if two_bp and not is_split(resolved):
        resolved = apply_two_bp(resolved, policy, costs=costs)
    elif not two_bp and is_split(resolved):
        try:
            resolved = merge_backward(resolved)
        except ValueError as exc:
            raise ScheduleConfigError(
                f"two_bp=False, but {resolved.name or 'the schedule'} is split into I and W "
                f"and cannot be merged back into B: {exc}"
            ) from exc
    if reduces:
        resolved = add_reductions(resolved)
    validate(resolved)
    return resolved
