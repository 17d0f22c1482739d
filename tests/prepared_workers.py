"""Functions the prepared-schedule tests run on every rank of a launched group."""

from __future__ import annotations

from typing import Any

import torch

from runtime_models import build_blocks, loss_fn
from twobp.runtime import Pipeline
from twobp.schedule import SCHEDULES, add_communication, is_split
from twobp.sim import CostModel
from twobp.sim.search import describe, simulate_option

N_MB = 4


def auto_and_simulated(
    model: str, costs: CostModel, data_parallel: int, stages_per_rank: int | None = None
) -> dict[str, Any]:
    """``schedule="auto"`` on a given cost model, and what the search simulated for its choice.

    Returns:
        ``runs``: the lowered schedule the pipeline runs, as text;
        ``simulated``: the schedule the simulator timed for the chosen
        option, rebuilt from the option alone and lowered the same way;
        ``fixed``: the lowered schedule of a pipeline given the chosen
        options by name (schedule, policy) instead of ``auto``, where the
        choice has no W cap; ``split``, ``fused_first_stage``: whether the
        schedule splits backwards and fuses the first stage's into ``B``;
        ``reductions``: its count of ``R``.
    """
    torch.set_num_threads(1)
    options: dict[str, Any] = {
        "n_microbatches": N_MB,
        "device": "cpu",
        "timeout": 30.0,
        "data_parallel": data_parallel,
        "costs": costs,
        "stages_per_rank": stages_per_rank,
    }
    pipe = Pipeline(build_blocks(model), loss_fn(model), schedule="auto", auto_trials=0, **options)
    assert pipe.plan is not None
    choice = pipe.plan.choice
    option = next(
        o
        for o in _options_of(choice.schedule)
        if (o.policy, o.stages_per_rank, o.microbatches_per_w)
        == (choice.policy, choice.stages_per_rank, choice.microbatches_per_w)
    )
    tied = model == "tied"
    _, simulated = simulate_option(
        option,
        pipe.schedule.n_ranks,
        N_MB,
        costs.for_stages,
        data_parallel=data_parallel,
        tied=tied,
    )
    assert simulated is not None
    out = {
        "runs": str(pipe.lowered_schedule),
        "simulated": str(add_communication(simulated)),
        "choice": choice.schedule,
        "described": describe(choice),
        "split": is_split(pipe.schedule),
        "fused_first_stage": any(
            a.kind.value == "B" and pipe.schedule.model_stage(a.stage) == 0
            for acts in pipe.schedule.actions.values()
            for a in acts
        ),
        "reductions": sum(
            a.kind.value == "R" for acts in pipe.schedule.actions.values() for a in acts
        ),
    }
    pipe.close()
    native = SCHEDULES[choice.schedule].natively_split
    if choice.policy != "off" and choice.microbatches_per_w is None and not native:
        fixed = Pipeline(
            build_blocks(model),
            loss_fn(model),
            schedule=choice.schedule,
            two_bp_policy=choice.policy,
            **{**options, "stages_per_rank": choice.stages_per_rank},
        )
        out["fixed"] = str(fixed.lowered_schedule)
        fixed.close()
    return out


def _options_of(name: str) -> list[Any]:
    from twobp.sim.search import options

    return options(N_MB, schedules=[name])
