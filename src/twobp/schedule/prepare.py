"""The one preparation pass: from a schedule argument to the compute schedule that runs.

Every consumer of a runnable schedule takes it from here: the runtime
(``Pipeline``), ``schedule="auto"`` and ``twobp plan`` (through
:mod:`twobp.sim.candidate`), ``twobp simulate``, ``twobp train``'s checks
before any rank starts, and the bench. The pass is a chain of small pure
passes, always in this order::

    source_schedule   generate a name, load a CSV or take a Schedule; check it
                      against the group and the micro-batch count; compute-only
    finish_schedule   2BP: split and place W by the policy, its costs and caps
                      (or merge a split schedule back into B, with two_bp=False)
                      first stage: an I directly followed by its own W becomes B
                      R after each stage's last W, where gradients are reduced
                      validate, once

:func:`prepare` runs both. The simulator fits its cost model to the sourced
schedule before it finishes it (the 2BP placement reads the costs), which is
why the two halves are apart; nothing else is done between them. The
communication (``SEND_*``/``RECV_*``) is placed afterwards by
:func:`twobp.schedule.add_communication` on exactly this schedule.

This module imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from twobp.schedule._timing import Costs
from twobp.schedule.csv_io import load_csv
from twobp.schedule.lowering import (
    add_reductions,
    compute_only,
    fuse_first_stage_backward,
    has_reductions,
    is_split,
    merge_backward,
    merge_stages,
)
from twobp.schedule.registry import SCHEDULES, generate
from twobp.schedule.schedule import Schedule
from twobp.schedule.two_bp import (
    DYNAMIC,
    TWO_BP_POLICIES,
    apply_two_bp,
    places_weights_at_run_time,
)
from twobp.schedule.validate import validate

DEFAULT_MICROBATCHES = 8
"""Micro-batches per step when a schedule is given by name without a count."""


class ScheduleConfigError(ValueError):
    """A schedule argument that cannot be resolved: unknown, or not fitting the group."""


def reduces(schedule: Schedule, data_parallel: int = 1, tied: bool = False) -> bool:
    """True if the schedule's stages reduce their gradients over several ranks (``R``).

    A stage is held by several ranks when the pipeline has data-parallel
    copies or the schedule runs several pipelines (Chimera); a weight tied
    across stages (an embedding read again by the head) is reduced over the
    ranks of its stages. A schedule that already lists ``R`` keeps it.

    Args:
        schedule: a compute schedule.
        data_parallel: copies of the pipeline ``D``.
        tied: True if some parameter is used by more than one block of the model.
    """
    return data_parallel > 1 or schedule.n_pipelines > 1 or tied or has_reductions(schedule)


def fitted_costs(costs: Costs, schedule: Schedule) -> Costs:
    """``costs`` fitted to the schedule's stages, as the planner fits them.

    A cost model of the model's stages (``twobp.sim.CostModel``, which has
    ``for_schedule``) is split where the schedule has more stages per
    pipeline and tiled over its pipelines; a mapping of times or None is
    taken as it is.

    Raises:
        ValueError: if the model's stages do not split into the schedule's.
    """
    fit = getattr(costs, "for_schedule", None)
    if fit is None:
        return costs
    fitted: Costs = fit(schedule.n_stages, schedule.n_pipelines)
    return fitted


TwoBP = bool | Sequence[bool]
"""What ``two_bp`` takes here: one switch for every stage, or one per stage of the model."""


def split_per_stage(two_bp: TwoBP, n_stages: int) -> tuple[bool, ...]:
    """Whether each stage of the model splits its backward (2BP) or runs a fused ``B``.

    Args:
        two_bp: True or False for every stage, or a list or tuple of one bool per
            stage of the model (``Schedule.pipeline_stages``; a schedule of several
            pipelines, Chimera, splits each replica of a stage alike).
        n_stages: stages of the model.

    Returns:
        One bool per stage.

    Raises:
        ScheduleConfigError: on a list of another length, or an entry that is not a bool.
    """
    if isinstance(two_bp, bool):
        return (two_bp,) * n_stages
    if not isinstance(two_bp, (list, tuple)) or not all(isinstance(b, bool) for b in two_bp):
        raise ScheduleConfigError(
            f"two_bp={two_bp!r}: give True (split every backward into I and W), False "
            "(fused B), or a list with one True or False per stage of the model"
        )
    if len(two_bp) != n_stages:
        raise ScheduleConfigError(
            f"two_bp={list(two_bp)!r}: {len(two_bp)} entries for {n_stages} stages; give one "
            "True or False per stage of the model, or one bool for all"
        )
    return tuple(two_bp)


def source_schedule(
    schedule: str | os.PathLike[str] | Schedule,
    *,
    n_ranks: int,
    n_microbatches: int | None = None,
    stages_per_rank: int | None = None,
) -> Schedule:
    """The compute-only schedule a name, a CSV file or a :class:`Schedule` stands for.

    Args:
        schedule: a name of :data:`twobp.schedule.SCHEDULES`, a CSV path, or a
            :class:`Schedule`.
        n_ranks: ranks of one copy of the pipeline; the schedule must use exactly these.
        n_microbatches: micro-batches per step; None takes the schedule's own
            (or :data:`DEFAULT_MICROBATCHES` for a name).
        stages_per_rank: for a name, stages per rank (None: the schedule's default).

    Returns:
        The schedule without communication actions. One given as a Schedule
        or a file is validated here (its own mistakes are named before any
        pass runs on it); a generated one is valid by construction and
        validated once, finished.

    Raises:
        ScheduleConfigError: if the schedule is unknown, does not fit the
            group or the micro-batch count.
        twobp.schedule.ScheduleError: if a given schedule is incomplete or deadlocks.
    """
    if n_microbatches is not None and n_microbatches < 1:
        raise ScheduleConfigError(f"n_microbatches must be at least 1, got {n_microbatches}")
    given = True
    if isinstance(schedule, Schedule):
        sourced = schedule
        if n_microbatches is not None and n_microbatches != schedule.n_microbatches:
            raise ScheduleConfigError(
                f"n_microbatches={n_microbatches} but the schedule "
                f"{schedule.name or ''} covers {schedule.n_microbatches}; leave n_microbatches "
                "unset or make them agree"
            )
    elif isinstance(schedule, str) and schedule in SCHEDULES:
        given = False
        m = DEFAULT_MICROBATCHES if n_microbatches is None else n_microbatches
        try:
            sourced = generate(schedule, n_ranks, m, stages_per_rank=stages_per_rank)
        except ValueError as exc:
            raise ScheduleConfigError(f"cannot build schedule {schedule!r}: {exc}") from exc
    elif Path(schedule).suffix.lower() == ".csv" or Path(schedule).is_file():
        if not Path(schedule).is_file():
            raise ScheduleConfigError(f"schedule file {os.fspath(schedule)!r} does not exist")
        sourced = load_csv(os.fspath(schedule))
        if n_microbatches is not None and n_microbatches != sourced.n_microbatches:
            raise ScheduleConfigError(
                f"n_microbatches={n_microbatches} but {os.fspath(schedule)!r} covers "
                f"{sourced.n_microbatches} micro-batches"
            )
    else:
        raise ScheduleConfigError(
            f"unknown schedule {schedule!r}: give one of {', '.join(SCHEDULES)}, "
            "a Schedule object or the path of a CSV file"
        )
    if sourced.n_ranks != n_ranks:
        raise ScheduleConfigError(
            f"schedule {sourced.name or ''} places its stages on {sourced.n_ranks} ranks, "
            f"but the group has {n_ranks}; start {sourced.n_ranks} processes or use a "
            f"schedule for {n_ranks}"
        )
    sourced = compute_only(sourced)
    if given:
        validate(sourced)
    return sourced


def finish_schedule(
    schedule: Schedule,
    *,
    two_bp: TwoBP,
    policy: str = "paper",
    costs: Costs = None,
    held: int | None = None,
    microbatches_per_w: int | None = None,
    reduce: bool = False,
    place_split: bool = False,
) -> Schedule:
    """The schedule that runs: 2BP, first-stage fusion and reductions, validated.

    Args:
        schedule: a compute-only schedule (:func:`source_schedule`).
        two_bp: split fused backwards (True) or merge split ones (False).
            A natively split schedule (``zb-*``) keeps its own ``I``/``W``
            (under ``dynamic`` as where each ``W`` runs if no wait ran it before).
            One bool per stage of the model (:func:`split_per_stage`): the
            schedule is split as with True, ``W`` placed, and then the stages
            given False are merged back into ``B`` (every replica of each).
        policy: the 2BP policy by which :func:`apply_two_bp` places ``W``.
        costs: the cost model by which ``paper`` and ``fill`` place ``W``
            (fitted to ``schedule``'s stages); None: unit times.
        held: for ``fill``, the most micro-batches a rank may hold from ``F``
            until ``W`` (a memory limit in micro-batches).
        microbatches_per_w: the most micro-batches one ``W`` action covers (None: no cap).
        reduce: put an ``R`` after every stage's last ``W`` or ``B``
            (:func:`reduces` says when); a schedule that lists ``R`` keeps them
            either way, placed again.
        place_split: with ``two_bp``, place the ``W`` of a schedule that is
            already split by ``policy`` too (the planner's policies on a
            ``zb-*``, ``costs="profile"``); False keeps a split schedule's own.

    Returns:
        The validated compute schedule.

    Raises:
        ScheduleConfigError: if the policy is unknown, or a split schedule
            cannot be merged.
        ValueError: if the costs, ``held`` or ``microbatches_per_w`` do not fit the policy.
        twobp.schedule.ScheduleError: if the result is incomplete or deadlocks.
    """
    _check_policy(policy)
    per_stage = split_per_stage(two_bp, schedule.pipeline_stages)
    two_bp = any(per_stage)
    reduce = reduce or has_reductions(schedule)
    finished = schedule
    if two_bp and (place_split or not is_split(finished)):
        finished = apply_two_bp(
            finished, policy, costs=costs, memory_limit=held, microbatches_per_w=microbatches_per_w
        )
    elif two_bp and policy == DYNAMIC and not places_weights_at_run_time(finished):
        # Its own W placement stays, as the places W runs at if no wait ran it before.
        finished = finished.with_actions(finished.actions, f"{finished.name}+2bp:{DYNAMIC}")
    elif not two_bp and is_split(finished):
        try:
            finished = merge_backward(finished)
        except ValueError as exc:
            raise ScheduleConfigError(
                f"two_bp=False, but {finished.name or 'the schedule'} is split into I and W "
                f"and cannot be merged back into B: {exc}"
            ) from exc
    if two_bp and not all(per_stage):
        fused = [s for s in range(finished.n_stages) if not per_stage[finished.model_stage(s)]]
        merged = merge_stages(finished, fused)
        split = [str(s) for s, b in enumerate(per_stage) if b]
        finished = merged.with_actions(merged.actions, f"{merged.name}:stages={','.join(split)}")
    # Nobody waits for the first stage's input gradient: its I and W run as one B (under
    # dynamic, its cool-down's too).
    finished = fuse_first_stage_backward(finished, out_of_groups=two_bp and policy == DYNAMIC)
    if reduce:
        finished = add_reductions(finished)
    validate(finished)
    return finished


def prepare(
    schedule: str | os.PathLike[str] | Schedule,
    *,
    n_ranks: int,
    n_microbatches: int | None = None,
    two_bp: TwoBP = True,
    policy: str = "paper",
    stages_per_rank: int | None = None,
    costs: Costs = None,
    microbatches_per_w: int | None = None,
    data_parallel: int = 1,
    tied: bool = False,
) -> Schedule:
    """:func:`source_schedule`, then :func:`finish_schedule`: the schedule a pipeline runs.

    Args:
        schedule, n_ranks, n_microbatches, stages_per_rank: as for :func:`source_schedule`.
        two_bp, policy, microbatches_per_w: as for :func:`finish_schedule`.
        costs: as for :func:`finish_schedule`, of the model's stages: fitted
            to the schedule's by :func:`fitted_costs`.
        data_parallel, tied: the pipeline's copies and whether some weight is
            used by several blocks (:func:`reduces`).

    Returns:
        The validated compute schedule.

    Raises:
        ScheduleConfigError: see :func:`source_schedule` and :func:`finish_schedule`.
        twobp.schedule.ScheduleError: if it is incomplete or deadlocks.
    """
    _check_policy(policy)
    sourced = source_schedule(
        schedule, n_ranks=n_ranks, n_microbatches=n_microbatches, stages_per_rank=stages_per_rank
    )
    try:
        return finish_schedule(
            sourced,
            two_bp=two_bp,
            policy=policy,
            costs=fitted_costs(costs, sourced),
            microbatches_per_w=microbatches_per_w,
            reduce=reduces(sourced, data_parallel, tied),
        )
    except ValueError as exc:
        if type(exc) is not ValueError:  # a ScheduleConfigError or ScheduleError already says it
            raise
        raise ScheduleConfigError(str(exc)) from exc


def _check_policy(policy: str) -> None:
    """Refuse an unknown 2BP policy, naming the options that set it."""
    if policy not in TWO_BP_POLICIES:
        raise ScheduleConfigError(
            f"unknown 2BP policy {policy!r}; use one of {', '.join(TWO_BP_POLICIES)} "
            "(two_bp_policy= of the Pipeline, --policy of twobp train)"
        )
