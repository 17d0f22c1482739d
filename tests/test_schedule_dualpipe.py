"""DualPipeV and DualPipe as data: placement, order, validity, memory, 2BP and mistakes.

Their order against torch's ``ScheduleDualPipeV`` is in test_schedule_torch_reference.
"""

from __future__ import annotations

from itertools import accumulate

import pytest

from twobp.schedule import (
    SCHEDULES,
    ScheduleConfigError,
    add_communication,
    apply_two_bp,
    from_rows,
    generate,
    prepare,
    to_rows,
    validate,
)
from twobp.schedule.action import Kind
from twobp.schedule.chimera import chimera_placement
from twobp.schedule.dualpipe import dualpipe, dualpipev
from twobp.schedule.kinds import ACTIVATIONS
from twobp.schedule.lowering import has_reductions, is_split
from twobp.schedule.zero_bubble import v_placement
from twobp.sim import simulate
from twobp.sim.costs import CostModel
from twobp.sim.search import auto_options


def rows(name: str, p: int, m: int) -> list[str]:
    return [" ".join(r) for r in to_rows(generate(name, p, m))]


def test_the_docstring_examples():
    assert rows("dualpipev", 2, 4) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]
    assert rows("dualpipe", 2, 4) == [
        "0F0 3F2 0F1 3B2 3F3 0B0 3B3 0I1 0W1",
        "2F2 1F0 2F3 1B0 1F1 2B2 1B1 2I3 2W3",
    ]


def test_dualpipev_holds_two_stages_of_one_copy_in_a_v():
    s = dualpipev(4, 8)
    assert s.placement == v_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.n_pipelines == 1 and s.pipeline_stages == 8
    assert s.stages_of(1) == (1, 6)
    # The data enters and the loss is computed on rank 0.
    assert s.rank_of(0) == s.rank_of(7) == 0


def test_dualpipe_holds_a_stage_of_both_pipelines_on_every_rank():
    s = dualpipe(4, 8)
    assert s.placement == chimera_placement(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.n_pipelines == 2 and s.pipeline_stages == 4
    assert s.replicas_of(0) == (0, 4)  # model stage 0 on rank 0 (down) and rank 3 (up)
    assert s.microbatches_of(0) == range(0, 4) and s.microbatches_of(4) == range(4, 8)
    # Ranks r and p-1-r mirror each other: the same order, each stage's replica for it.
    for r in range(2):
        other = [((a.stage + 4) % 8, a.kind, a.microbatch % 4) for a in s.actions[3 - r]]
        assert [(a.stage, a.kind, a.microbatch % 4) for a in s.actions[r]] == other


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize("extra", [0, 2, 4, 10])
def test_valid_and_deadlock_free_with_its_transfers(name, p, extra):
    s = generate(name, p, 2 * p + extra)
    validate(s)
    validate(add_communication(s))
    for acts in s.actions.values():
        fused = [a for a in acts if a.kind is Kind.FULL_BACKWARD]
        split = [a for a in acts if a.kind is Kind.BACKWARD_INPUT]
        assert fused and (split or p == 2 or name == "dualpipe")  # its own B, I and W


def test_dualpipev_takes_odd_counts():
    validate(add_communication(generate("dualpipev", 3, 7)))


@pytest.mark.parametrize(
    ("name", "p", "m", "message"),
    [
        ("dualpipev", 4, 7, r"dualpipev needs at least 2p = 8 micro-batches on 4 ranks.*got 7"),
        ("dualpipe", 4, 6, r"dualpipe needs at least 2p = 8 micro-batches on 4 ranks.*got 6"),
        ("dualpipe", 3, 8, r"dualpipe needs an even number of ranks.*got 3"),
        ("dualpipe", 4, 9, r"dualpipe needs an even number of micro-batches.*got 9"),
    ],
)
def test_counts_the_published_schedules_do_not_take_are_refused(name, p, m, message):
    with pytest.raises(ValueError, match=message):
        generate(name, p, m)
    with pytest.raises(ScheduleConfigError, match=message):
        prepare(name, n_ranks=p, n_microbatches=m)


def test_stages_per_rank_are_fixed():
    with pytest.raises(ValueError, match="dualpipev takes stages_per_rank 2, got 3"):
        generate("dualpipev", 2, 4, stages_per_rank=3)
    with pytest.raises(ValueError, match="dualpipe takes stages_per_rank 1, got 2"):
        generate("dualpipe", 2, 4, stages_per_rank=2)


def peak_activations(name: str, p: int, m: int) -> list[int]:
    s = generate(name, p, m)
    return [
        max(accumulate(a.held_change(ACTIVATIONS) for a in acts)) for acts in s.actions.values()
    ]


@pytest.mark.parametrize("p", [2, 4, 8])
def test_activations_held_match_the_published_memory(p):
    # DualPipe: p + 1 micro-batches of a stage (1/p of the model) on every rank, DeepSeek's
    # "PP + 1". DualPipeV: 2p + 1 of a stage that is 1/(2p) of it, half a stage more than 1F1B.
    assert peak_activations("dualpipe", p, 4 * p) == [p + 1] * p
    assert peak_activations("dualpipev", p, 4 * p) == [2 * p + 1] * p


def test_without_two_bp_every_backward_is_fused():
    for name in ("dualpipev", "dualpipe"):
        s = prepare(name, n_ranks=4, n_microbatches=8, two_bp=False)
        assert not is_split(s)
        assert has_reductions(s) == (name == "dualpipe")


def test_with_two_bp_the_published_w_stay_and_the_first_stages_fuse():
    s = prepare("dualpipev", n_ranks=2, n_microbatches=4)
    assert " ".join(map(str, s.actions[0])).endswith("3B3 0B2 0B3")
    assert " ".join(map(str, s.actions[1])).endswith("2I3 1I3 2W3 1W3")
    # DualPipe's two first stages (0 on rank 0, 2 on rank 1) fuse; every stage reduces.
    d = prepare("dualpipe", n_ranks=2, n_microbatches=4)
    assert [str(a) for a in d.actions[0]][-4:] == ["3B3", "3R2-3", "0B1", "0R0-1"]


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("policy", ["eager", "paper", "fill"])
def test_every_policy_places_their_w_again(name, policy):
    s = apply_two_bp(generate(name, 4, 8), policy)
    validate(add_communication(s))
    kinds = {a.kind for acts in s.actions.values() for a in acts}
    assert Kind.FULL_BACKWARD not in kinds and Kind.BACKWARD_WEIGHT in kinds
    if policy == "paper":  # the rest at the end, as one concatenated W per stage
        assert any(len(a.microbatches) > 1 for acts in s.actions.values() for a in acts)


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
def test_csv_round_trip(name):
    s = prepare(name, n_ranks=4, n_microbatches=8)
    back = from_rows(to_rows(s), name=s.name)
    assert back == s and back.n_pipelines == SCHEDULES[name].pipelines


def test_auto_tries_dualpipev_but_not_two_pipelines():
    tried = {o.schedule for o in auto_options(8)}
    assert "dualpipev" in tried and "dualpipe" not in tried and "chimera" not in tried
    assert "dualpipev" not in {o.schedule for o in auto_options(8, two_bp=False)}


# Unit costs, B = I + W = 2 (W/B = 1/2); a V's stages take half of a rank's share each.
BUBBLES = {
    ("dualpipev", 4, 8): 25.5,
    ("dualpipe", 4, 8): 25.0,
    ("zb-v", 4, 8): 25.5,
    ("dualpipev", 8, 16): 51.5,
    ("dualpipe", 8, 16): 51.0,
}


@pytest.mark.parametrize(("key", "makespan"), BUBBLES.items(), ids=str)
def test_simulated_makespans_of_the_doc_table(key, makespan):
    name, p, m = key
    s = prepare(name, n_ranks=p, n_microbatches=m)
    costs = CostModel.uniform(p).for_schedule(s.n_stages, s.n_pipelines)
    assert simulate(s, costs).makespan == makespan
