"""What a run ran, as its report and its ``config.toml`` say it.

``schedule="auto"`` chooses the schedule, the 2BP policy, the stages per rank,
the partition and the W cap when the pipeline is built; the report names that
choice and why (its predicted and measured step), and the run's
``config.toml`` is rewritten with the choice in the place of ``auto``, so that
``twobp train --config OUT/config.toml`` runs the same pipeline again without
choosing.
"""

from __future__ import annotations

import math
from typing import Any

from twobp.runtime import Pipeline
from twobp.schedule import TWO_BP_POLICIES
from twobp.schedule.lowering import is_split
from twobp.schedule.rebuild import rebuilt_microbatches
from twobp.sim.candidate import describe
from twobp.train.config import TrainConfig


def what_ran(pipe: Pipeline, cfg: TrainConfig, precision: str) -> dict[str, Any]:
    """The pipeline's schedule, policy, copies, recompute mode, precision and scaler, and
    for ``auto`` its choice with the predicted and measured step (seconds)."""
    schedule = pipe.schedule
    plan = pipe.plan
    policy = plan.choice.policy if plan is not None else cfg.policy
    split = is_split(schedule)
    modes = sorted({m or "none" for m in pipe.recompute})
    scaler = pipe.grad_scaler
    ran: dict[str, Any] = {
        # The generator's name (the schedule's own says how it was transformed: 1f1b+2bp:paper).
        "schedule": plan.choice.schedule if plan is not None else cfg.schedule,
        "schedule_text": schedule.name,
        "two_bp": split,
        "policy": policy if split else None,
        "stages_per_rank": schedule.pipeline_stages // max(1, schedule.n_ranks),
        "partition": [len(r) for r in pipe.stage_blocks],
        "partition_by": pipe.partition_by,
        "weight_group_size": (
            plan.choice.weight_group_size if plan is not None else cfg.weight_group_size
        ),
        "data_parallel": pipe.dp_size,
        "recompute": modes[0] if len(modes) == 1 else [m or "none" for m in pipe.recompute],
        "precision": precision,
        "scaler": _scaler_name(scaler),
        "auto": None,
        # two_bp unset: the stages 2BP was found to pay on, and the predictions.
        "two_bp_choice": None if pipe.two_bp_choice is None else pipe.two_bp_choice.summary(),
        # recompute="auto" on a schedule by name: kept as it is, or what was rebuilt, and why.
        "rebuild_choice": None if pipe.rebuild_choice is None else pipe.rebuild_choice.summary(),
    }
    given = pipe.options.two_bp
    if cfg.two_bp is None and isinstance(given, (list, tuple)):
        # A resume: the stages the run it continues chose (twobp.train.checkpointing).
        ran["two_bp_choice"] = resumed_split_text(given)

    rebuilt = rebuilt_microbatches(schedule)
    if rebuilt:
        stashes = ", ".join(f"stage {s}: {list(m)}" for s, m in rebuilt.items())
        ran["recompute"] = f"auto (the stashes of {stashes} rebuilt)"
    if cfg.schedule == "auto" and plan is not None:
        measured = plan.trial_time(plan.choice)
        if measured is not None and not math.isfinite(measured):
            measured = None
        ran["auto"] = {
            "choice": describe(plan.choice),
            "predicted_step_s": plan.predicted_step_time,
            "measured_step_s": measured,
            "tried": sum(math.isfinite(t) for t in plan.trial_times),
            "simulated": sum(c.ok for c in plan.ranking),
            "why": plan.summary(),
        }
    return ran


def resumed_split_text(split: list[bool] | tuple[bool, ...]) -> str:
    """One line: the stages a resume splits, as the run it continues chose (pure)."""
    stages = [s for s, b in enumerate(split) if b]
    which = ", ".join(map(str, stages)) if stages else "none"
    return f"2BP on the stages the resumed run chose by its profile: {which} (not profiled again)"


def _scaler_name(scaler: object) -> str:
    """``"none"``, or the class of the gradient scaler the pipeline steps with."""
    if scaler is None or scaler is False:
        return "none"
    if scaler is True:
        return "GradScaler"
    return type(scaler).__name__


def chosen_options(ran: dict[str, Any]) -> dict[str, Any]:
    """The options of ``config.toml`` that repeat the choice of ``auto`` (pure)."""
    options: dict[str, Any] = {
        "schedule": ran["schedule"],
        "two_bp": ran["two_bp"],
        "partition": ",".join(map(str, ran["partition"])),
        # Always written: a schedule that runs 1 stage per rank may default to more.
        "stages_per_rank": ran["stages_per_rank"],
        "weight_group_size": ran["weight_group_size"],
        "memory_limit": None,
    }
    if ran["policy"] in TWO_BP_POLICIES:
        # (A zero-bubble schedule that keeps its own W placement runs with no policy.)
        options["policy"] = ran["policy"]
    return options
