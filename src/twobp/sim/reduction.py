"""The gradient reduction of replicated stages in the simulator.

With ``D`` data-parallel copies of a pipeline (and Chimera's two pipelines
inside each), every stage of the model is held by ``D * n_pipelines`` ranks,
which all-reduce its weight gradients once per step. The schedule's ``R``
action starts that all-reduce in the background right after the stage's last
``W`` (or ``B``), so that it overlaps the rank's remaining work;
:func:`reduction_costs` gives their time (a ring all-reduce
of the stage's gradients, the size of its weights, at the cost model's
bandwidth and latency); the actions themselves are placed by the preparation
pass (:mod:`twobp.schedule.prepare`), or by :func:`with_reductions` on a
schedule built by hand. :func:`reductions_at_end` is the same reduction
started only after the rank's last action, as a step without overlap would
run it, for comparison. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from twobp.schedule.action import Kind
from twobp.schedule.lowering import add_reductions
from twobp.schedule.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.timeline import Span


def reduction_costs(schedule: Schedule, costs: CostModel, data_parallel: int = 1) -> CostModel:
    """The costs with the time of each stage's all-reduce over the ranks that hold it.

    A stage is held by ``data_parallel * n_pipelines`` ranks, and its ``R``
    all-reduces the size of its weights (``parameter_bytes``). A weight tied
    across the stages of one pipeline (``D = 1``, one pipeline) has an ``R``
    too, which this model does not time (one weight, in the background).

    Raises:
        ValueError: if ``data_parallel < 1``.
    """
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    replicas = data_parallel * schedule.n_pipelines
    if replicas == 1:
        return costs
    assert costs.parameter_bytes is not None
    return costs.with_reduction(replicas, costs.parameter_bytes)


def with_reductions(
    schedule: Schedule, costs: CostModel, data_parallel: int = 1
) -> tuple[Schedule, CostModel]:
    """A hand-built schedule with an ``R`` per stage and the costs with its time.

    Schedules prepared by :func:`twobp.schedule.prepare.prepare` (and the
    planner's, :mod:`twobp.sim.candidate`) have their ``R`` already; this is
    for a schedule built or edited by hand.

    Args:
        schedule: a compute schedule.
        costs: its cost model (one entry per stage); ``parameter_bytes``
            are taken as the bytes of a stage's gradients.
        data_parallel: copies of the pipeline ``D``.

    Returns:
        Both unchanged when no stage is replicated (``D = 1``, one pipeline).

    Raises:
        ValueError: if ``data_parallel < 1``.
    """
    timed = reduction_costs(schedule, costs, data_parallel)
    if timed is costs:
        return schedule, costs
    return add_reductions(schedule), timed


def reductions_at_end(schedule: Schedule) -> Schedule:
    """The schedule with every ``R`` moved after its rank's last action (no overlap)."""
    actions = {
        rank: [a for a in acts if a.kind is not Kind.REDUCE]
        + [a for a in acts if a.kind is Kind.REDUCE]
        for rank, acts in schedule.actions.items()
    }
    return schedule.with_actions(actions)


def reduction_ends(
    schedule: Schedule,
    costs: CostModel,
    spans: Sequence[Span],
    work: Mapping[int, float] | None = None,
    scatters: Collection[int] = (),
) -> dict[int, float]:
    """When each gradient reduction of a simulated step ends.

    The replicas of a stage in the schedule (Chimera's two pipelines) reduce
    together: the all-reduce starts once every one of them has issued its
    ``R``, and alone takes ``costs.reduce`` of its stage. A rank's link is
    shared: while it takes part in ``k`` all-reduces at once, each gets
    ``1 / k`` of it, and an all-reduce goes at the pace of its slowest rank.
    Replicas in other copies of the pipeline (data parallel) run the same
    schedule and issue theirs at the same time.

    Args:
        schedule: the simulated schedule.
        costs: its cost model.
        spans: the simulated spans; those of ``R`` start at their issue.
        work: ``index in spans -> time alone`` where it is not the ``R``'s cost (an ``R``
            left nothing to send by the reduce-scatters after each ``W``: 0).
        scatters: the indices of the spans of ``R`` that are a reduce-scatter after one
            ``W`` (sharded parameters, ``CostModel.scatter_each_w``): each one reduction
            of its own, not met by the stage's replicas.

    Returns:
        ``index in spans -> end`` for every ``R``.
    """
    members: dict[tuple[int, int], list[int]] = {}
    alone = set(scatters)
    for i, span in enumerate(spans):
        a = span.action
        if a.kind is Kind.REDUCE:
            key = (schedule.model_stage(a.stage), i if i in alone else -1)
            members.setdefault(key, []).append(i)
    given = work or {}
    ready = {k: max(spans[i].start for i in idx) for k, idx in members.items()}
    left = {
        k: given.get(idx[0], costs.duration(spans[idx[0]].action)) for k, idx in members.items()
    }
    ranks = {k: {spans[i].rank for i in idx} for k, idx in members.items()}
    ends: dict[int, float] = {}
    for k in [k for k, t in left.items() if t <= 0.0]:
        del left[k]
        for i in members[k]:
            ends[i] = ready[k]
    now = min(ready.values(), default=0.0)
    while left:
        active = [k for k in left if ready[k] <= now]
        if not active:
            now = min(ready[k] for k in left)
            continue
        load: dict[int, int] = {}
        for k in active:
            for r in ranks[k]:
                load[r] = load.get(r, 0) + 1
        rate = {k: 1.0 / max(load[r] for r in ranks[k]) for k in active}
        finish = min(now + left[k] / rate[k] for k in active)
        arrival = min((ready[k] for k in left if ready[k] > now), default=finish)
        step_to = min(finish, arrival)
        for k in active:
            left[k] -= (step_to - now) * rate[k]
            if left[k] <= 1e-12 * max(1.0, costs.duration(spans[members[k][0]].action)):
                del left[k]
                for i in members[k]:
                    ends[i] = step_to
        now = step_to
    return ends
