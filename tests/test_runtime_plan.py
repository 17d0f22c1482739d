"""Pure parts of the runtime: communication plan, partition, schedule resolution (no processes)."""

from __future__ import annotations

import functools

import pytest
import torch

from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.clock import StepClock
from twobp.runtime.execution.step_run import StepRun
from twobp.runtime.setup.stage_blocks import stage_counts
from twobp.schedule import (
    SCHEDULES,
    Action,
    Kind,
    KindSpec,
    Need,
    Schedule,
    ScheduleConfigError,
    ScheduleError,
    add_communication,
    apply_two_bp,
    declare_kind,
    forward_only,
    fuse_first_stage_backward,
    generate,
    is_split,
    prepare,
    save_csv,
)
from twobp.schedule.schedule import StageGraph
from twobp.schedule.transfers import (
    Direction,
    Transfer,
    needed_transfer,
    plan_communication,
    produced_transfer,
)

ALL = [
    (name, p, m, policy)
    for name in SCHEDULES
    for p in (2, 4)
    for m in (4, 8)
    for policy in (None, "paper", "fill")
    if not (name == "interleaved-1f1b" and m % p)
    and not (name.startswith("dualpipe") and m < 2 * p)
]


@functools.cache
def _build(name: str, p: int, m: int, policy: str | None) -> Schedule:
    schedule = generate(name, p, m)
    return schedule if policy is None else apply_two_bp(schedule, policy)


def test_transfers_of_actions():
    graph = StageGraph((0, 1, 1, 0), n_pipelines=1)  # a V: stages 1 and 2 share rank 1
    f1 = Action.parse("1F3")
    assert needed_transfer(f1, graph) == Transfer(Direction.ACTIVATION, 0, 3, 0, 1)
    assert produced_transfer(f1, graph) == Transfer(Direction.ACTIVATION, 1, 3, 1, 1)
    assert produced_transfer(f1, graph).is_local
    i2 = Action.parse("2I5")
    assert needed_transfer(i2, graph) == Transfer(Direction.GRADIENT, 2, 5, 0, 1)
    assert produced_transfer(i2, graph) == Transfer(Direction.GRADIENT, 1, 5, 1, 1)
    assert needed_transfer(Action.parse("0F0"), graph) is None
    assert needed_transfer(Action.parse("3B0"), graph) is None
    assert produced_transfer(Action.parse("0B0"), graph) is None
    assert needed_transfer(Action.parse("2W0-3"), graph) is None
    assert "rank 0 -> rank 1" in str(needed_transfer(i2, graph))


def test_plan_of_1f1b_two_ranks():
    plan = plan_communication(generate("1f1b", 2, 2), 0)
    ops = [
        (op.is_send, op.transfer.direction.value, op.transfer.microbatch) for op in plan.peers[1]
    ]
    assert ops == [
        (True, "activation", 0),
        (True, "activation", 1),
        (False, "gradient", 0),
        (False, "gradient", 1),
    ]
    mirrored = plan_communication(generate("1f1b", 2, 2), 1).peers[0]
    assert [(not op.is_send, op.transfer) for op in mirrored] == [
        (op.is_send, op.transfer) for op in plan.peers[1]
    ]


@pytest.mark.parametrize(("name", "p", "m", "policy"), ALL)
def test_pair_orders_agree_and_follow_each_rank(name, p, m, policy):
    schedule = _build(name, p, m, policy)
    plans = {r: plan_communication(schedule, r) for r in range(p)}
    remote = 0
    for r, plan in plans.items():
        position = {}
        for i, a in enumerate(schedule.actions[r]):
            t = produced_transfer(a, schedule.graph)
            if t is not None:
                position[t] = i
        for peer, ops in plan.peers.items():
            # Both ranks list the same transfers in the same order, mirrored.
            assert [(not o.is_send, o.transfer) for o in plans[peer].peers[r]] == [
                (o.is_send, o.transfer) for o in ops
            ]
            sends = [position[o.transfer] for o in ops if o.is_send]
            assert sends == sorted(sends), "sends must follow the rank's own action order"
            remote += len(ops)
    crossings = sum(
        schedule.neighbour(s, 1) is not None and schedule.placement[s] != schedule.placement[s + 1]
        for s in range(schedule.n_stages - 1)
    )
    per_pipeline = m // schedule.n_pipelines
    # Each transfer: a send and a receive; F and B.
    assert remote == 2 * 2 * crossings * per_pipeline


def _run_in_order(schedule: Schedule) -> None:
    """Run the posting rules of the channel over in-order links (as NCCL matches).

    Each rank posts receives ahead up to its next send in each pair order and
    posts a send right after the action that makes it; the k-th operation on
    a link completes once both ends have posted their k-th operation. Fails
    if the ranks stop making progress.
    """
    ranks = range(schedule.n_ranks)
    plans = {r: plan_communication(schedule, r) for r in ranks}
    posted = {(r, q): 0 for r in ranks for q in plans[r].peers}
    index = {
        (r, q): {op.transfer: k for k, op in enumerate(ops)}
        for r in ranks
        for q, ops in plans[r].peers.items()
    }
    position = dict.fromkeys(ranks, 0)

    def post_ahead(r: int, q: int) -> None:
        ops = plans[r].peers[q]
        while posted[r, q] < len(ops) and not ops[posted[r, q]].is_send:
            posted[r, q] += 1

    for r in ranks:
        for q in plans[r].peers:
            post_ahead(r, q)
    while any(position[r] < len(schedule.actions[r]) for r in ranks):
        progress = False
        for r in ranks:
            if position[r] == len(schedule.actions[r]):
                continue
            action = schedule.actions[r][position[r]]
            need = needed_transfer(action, schedule.graph)
            if need is not None and not need.is_local:
                k = index[r, need.src][need]
                if not (posted[r, need.src] > k and posted[need.src, r] > k):
                    continue
            made = produced_transfer(action, schedule.graph)
            if made is not None and not made.is_local:
                q = made.dst
                assert plans[r].peers[q][posted[r, q]].transfer == made
                posted[r, q] += 1
                post_ahead(r, q)
            position[r] += 1
            progress = True
        assert progress, f"in-order links deadlock at {position}"


@pytest.mark.parametrize(("name", "p", "m", "policy"), ALL)
def test_in_order_links_do_not_deadlock(name, p, m, policy):
    """What NCCL needs: both ends of a link post in one order, and nobody waits forever."""
    _run_in_order(_build(name, p, m, policy))


def test_forward_only_keeps_the_forwards():
    schedule = forward_only(apply_two_bp(generate("zb-v", 2, 4), "paper"))
    assert {a.kind for acts in schedule.actions.values() for a in acts} == {Kind.FORWARD}
    _run_in_order(schedule)


def test_stage_counts():
    assert stage_counts(10, 2, None) == [5, 5]
    assert stage_counts(10, 4, "uniform") == [2, 3, 3, 2]
    assert stage_counts(10, 2, [3, 7]) == [3, 7]
    assert stage_counts(10, 2, "balanced") is None
    with pytest.raises(PipelineConfigError, match="3 blocks but the schedule has 4 stages"):
        stage_counts(3, 4, None)
    with pytest.raises(PipelineConfigError, match="unknown partition strategy 'even'"):
        stage_counts(10, 2, "even")
    with pytest.raises(PipelineConfigError, match="covers 9 blocks"):
        stage_counts(10, 2, [4, 5])
    with pytest.raises(PipelineConfigError, match="has 3 stages"):
        stage_counts(10, 2, [4, 5, 1])


@pytest.mark.parametrize(
    ("n_blocks", "n_stages", "partition"),
    [(10, 2, None), (10, 4, "uniform"), (10, 2, [3, 7]), (3, 4, None), (10, 2, "even"),
     (10, 2, [4, 5]), (10, 2, [4, 5, 1]), (10, 2, [10, 0])],
)  # fmt: skip
def test_stage_counts_follow_the_rules_of_the_simulators_partition(n_blocks, n_stages, partition):
    from twobp.sim.from_profile import partition_for

    try:
        expected = list(partition_for(n_blocks, partition, None)(n_stages))
    except ValueError as exc:
        with pytest.raises(PipelineConfigError) as raised:
            stage_counts(n_blocks, n_stages, partition)
        assert str(raised.value) == str(exc)
    else:
        assert stage_counts(n_blocks, n_stages, partition) == expected


def _kinds(schedule: Schedule) -> set[str]:
    return {a.kind.value for acts in schedule.actions.values() for a in acts}


def test_prepare_by_name_and_two_bp():
    fused = prepare("1f1b", n_ranks=2, n_microbatches=4, two_bp=False)
    assert _kinds(fused) == {"F", "B"} and fused.n_microbatches == 4
    split = prepare("1f1b", n_ranks=2, n_microbatches=4, two_bp=True, policy="eager")
    # Eager puts each W right after its I: the first stage's pair runs fused, as one B.
    assert _kinds(split) == {"F", "I", "W", "B"} and split.name.endswith("+2bp:eager")
    assert {a.kind.value for a in split.actions[0] if a.stage == 0} == {"F", "B"}
    assert {a.kind.value for a in split.actions[1]} == {"F", "I", "W"}
    zb = prepare("zb-h1", n_ranks=2, n_microbatches=4, two_bp=True)
    # Natively split: kept as generated, but for the first stage's fusion.
    assert zb == fuse_first_stage_backward(generate("zb-h1", 2, 4))
    merged = prepare("zb-h1", n_ranks=2, n_microbatches=4, two_bp=False)
    assert not is_split(merged)
    assert prepare("gpipe", n_ranks=2, n_microbatches=None, two_bp=False).n_microbatches == 8
    v = prepare("interleaved-1f1b", n_ranks=2, n_microbatches=4, two_bp=False)
    assert v.n_stages == 4


def test_prepare_objects_and_files(tmp_path):
    lowered = add_communication(generate("1f1b", 2, 4))
    resolved = prepare(lowered, n_ranks=2, n_microbatches=None, two_bp=False)
    assert _kinds(resolved) == {"F", "B"}  # communication derives from compute actions
    path = tmp_path / "mine.csv"
    save_csv(generate("gpipe", 2, 4), path)
    from_file = prepare(path, n_ranks=2, n_microbatches=4, two_bp=True)
    assert _kinds(from_file) == {"F", "I", "W"}
    with pytest.raises(ScheduleConfigError, match="covers 4"):
        prepare(generate("gpipe", 2, 4), n_ranks=2, n_microbatches=8, two_bp=True)
    with pytest.raises(ScheduleConfigError, match="on 2 ranks, but the group has 4"):
        prepare(generate("gpipe", 2, 4), n_ranks=4, n_microbatches=None, two_bp=True)
    with pytest.raises(ScheduleConfigError, match="unknown schedule 'pipedream'"):
        prepare("pipedream", n_ranks=2, n_microbatches=4, two_bp=True)
    with pytest.raises(ScheduleConfigError, match="does not exist"):
        prepare(str(tmp_path / "missing.csv"), n_ranks=2, n_microbatches=4, two_bp=True)
    with pytest.raises(ScheduleConfigError, match="interleaved-1f1b"):
        prepare("interleaved-1f1b", n_ranks=4, n_microbatches=6, two_bp=True)


def test_prepare_rejects_incomplete_schedules():
    schedule = generate("gpipe", 2, 2)
    broken = schedule.with_actions(
        {r: [a for a in acts if str(a) != "1B1"] for r, acts in schedule.actions.items()}
    )
    with pytest.raises(ScheduleError):
        prepare(broken, n_ranks=2, n_microbatches=None, two_bp=False)


def test_a_pipeline_places_w_by_its_cost_model_and_runs_the_lowered_schedule(tmp_path):
    from runtime_models import train_reference
    from runtime_workers import placed_by_costs
    from twobp.runtime import launch
    from twobp.schedule import fuse_first_stage_backward
    from twobp.sim.cost_io import save_costs
    from twobp.sim.costs import CostModel

    path = tmp_path / "costs.json"
    per_stage = {"forward": (3.0, 3.0), "backward_input": (1.0, 1.0), "backward_weight": (0.2, 0.2)}
    save_costs(CostModel(**per_stage), path)
    results = launch(placed_by_costs, 2, str(path), 4, 8, threads_per_rank=1, timeout=120)
    costs = {"F": 3.0, "I": 1.0, "W": 0.2}
    planned = fuse_first_stage_backward(apply_two_bp(generate("1f1b", 2, 4), "paper", costs=costs))
    assert planned != fuse_first_stage_backward(apply_two_bp(generate("1f1b", 2, 4), "paper"))
    reference = train_reference("mlp", 4, 8)["losses"][0]
    for result in results:
        for label in ("mapping", "file"):
            assert result[label]["schedule"] == str(planned), label
            assert result[label]["lowered"] == str(add_communication(planned)), label
            assert result[label]["loss"] == pytest.approx(reference, abs=1e-10, rel=0)


def test_a_step_refuses_an_action_of_a_kind_it_has_no_handler_for():
    extra = declare_kind(KindSpec("X", "extra", needs=(Need("F"),), makes=("X",)))
    run = StepRun(0, StageGraph((0,), 1), {}, None, None, None, StepClock(torch.device("cpu")))
    with pytest.raises(ValueError, match=r"no handler runs X actions: .*take 0X0 out"):
        run.run([Action(0, extra, (0,))])
