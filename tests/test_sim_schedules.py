"""The generated schedules, simulated with unit costs, against closed forms.

Unit costs: F = I = W = 1 and a fused B = I + W = 2, so B = 2F. With V stages
per rank the costs are one rank's share of the model, each stage taking 1/V
(``CostModel.for_stages``). ``p`` ranks, ``m`` micro-batches; every rank
computes ``3m`` per step, so ``bubble = 1 - 3m / makespan``.
"""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from twobp.schedule import SCHEDULES, apply_two_bp, generate
from twobp.sim.costs import CostModel
from twobp.sim.simulate import simulate
from twobp.sim.steady import repeat_steps, steady_state


def run(name, p, m, policy=None, v=None):
    schedule = apply_two_bp(generate(name, p, m, stages_per_rank=v), policy)
    costs = CostModel.uniform(p).for_schedule(schedule.n_stages, schedule.n_pipelines)
    return simulate(schedule, costs), schedule, costs


def bubble(p, m, makespan):
    return 1 - 3 * m / makespan


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (3, 5), (8, 16)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    # Fill and drain take (p - 1)(F + B) = 3(p - 1): makespan 3(m + p - 1).
    result, _, _ = run(name, p, m)
    assert result.makespan == pytest.approx(3 * (m + p - 1))
    assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


# The 2BP paper's Figure 1 (F = I = W), p = 4 ranks and m = 4 micro-batches,
# with the paper policy: (schedule, V, makespan without 2BP, with 2BP).
#
# naive: micro-batches go through the pipeline one at a time: each takes p F
#   and p B in sequence, makespan 3pm = 48. With 2BP each takes p F and p I
#   (2pm = 32 in all); rank 0 fills its last wait with the stored W0..W2 and
#   ends with W3 after I3: 2pm + 1 = 33.
# gpipe: 3(m + p - 1) = 21. With 2BP the I wave needs m + (p - 1) after the
#   last rank's forwards end at m + p - 1, then rank 0 runs one concatenated
#   W of m: m + (p-1) + m + (p-1) + m = 3m + 2(p - 1) = 18.
# 1f1b (1F1B-1): 21 as GPipe. With 2BP, rank 0 runs its m <= p forwards, then
#   the gradient of micro-batch 0 reaches it at 2p - 1 (F through p stages, I
#   back through p - 1 others); from there it never waits: m I and m W,
#   makespan 2p - 1 + 2m = 15.
# interleaved-1f1b (1F1B-2, V = 2, each stage F = 0.5, B = 1): Megatron's
#   bubble (p - 1)(F + B)/V = 4.5 per rank, makespan 12 + 4.5 = 16.5. With
#   2BP, rank 0 ends its 2m forwards at 4 and waits for micro-batch 0's
#   gradient: stage 7 (rank 3) ends F0 at 4 and three I of 0.5 bring it back
#   to stage 4 at 5.5; no rank waits after that: makespan 12 + 1.5 = 13.5.
FIGURE_1 = [
    ("naive", None, 48.0, 33.0),
    ("gpipe", None, 21.0, 18.0),
    ("1f1b", None, 21.0, 15.0),
    ("interleaved-1f1b", 2, 16.5, 13.5),
]


@pytest.mark.parametrize(("name", "v", "without", "with_2bp"), FIGURE_1)
def test_two_bp_paper_figure_1(name, v, without, with_2bp):
    p = m = 4
    fused, _, _ = run(name, p, m, None, v)
    eager, _, _ = run(name, p, m, "eager", v)
    paper, _, _ = run(name, p, m, "paper", v)
    assert fused.makespan == pytest.approx(without)
    assert fused.bubble_ratio == pytest.approx(bubble(p, m, without))
    assert paper.makespan == pytest.approx(with_2bp)
    assert paper.bubble_ratio == pytest.approx(bubble(p, m, with_2bp))
    # W right after I: never slower than fused (the gradient leaves earlier).
    assert eager.makespan <= fused.makespan + 1e-9
    assert paper.makespan <= eager.makespan + 1e-9


def test_naive_single_microbatch():
    # One micro-batch: p F then p B in sequence, 3p; with 2BP, p F, p I and
    # rank 0's W after its I: 2p + 1. Bubbles (p-1)/p and 1 - 3/(2p+1).
    p = 4
    fused, _, _ = run("naive", p, 1)
    paper, _, _ = run("naive", p, 1, "paper")
    assert fused.makespan == 3 * p and fused.bubble_ratio == pytest.approx((p - 1) / p)
    assert paper.makespan == 2 * p + 1
    assert paper.bubble_ratio == pytest.approx(1 - 3 / (2 * p + 1))


@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 8), (4, 16), (3, 9)])
def test_zb_h1_idle_is_a_third_of_1f1b(p, m):
    # 1F1B idles (p - 1)(F + B) = 3(p - 1) per rank; ZB-H1 (p - 1)(F + I - W)
    # = p - 1, a third.
    one_f_one_b, _, _ = run("1f1b", p, m)
    zb_h1, _, _ = run("zb-h1", p, m)
    assert one_f_one_b.idle == pytest.approx((3 * (p - 1),) * p)
    assert zb_h1.idle == pytest.approx((p - 1,) * p)
    assert zb_h1.makespan == pytest.approx(3 * m + p - 1)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 12), (3, 6), (2, 8)])
def test_zb_h2_has_no_bubble_in_steady_state(p, m):
    # One step alone still fills and drains: rank p-1 starts p - 1 late and
    # rank 0 ends p - 1 early, makespan 3m + p - 1. But with m >= 2p no rank
    # waits between its first and last action, so steps run back to back
    # without a barrier tile with period 3m: zero bubble.
    result, schedule, costs = run("zb-h2", p, m)
    assert result.makespan == pytest.approx(3 * m + p - 1)
    steady = steady_state(schedule, costs)
    assert steady.period == pytest.approx(3 * m)
    assert steady.bubble_ratio == pytest.approx(0.0, abs=1e-12)
    # 1F1B gains nothing from overlapping steps: rank 0 ends last.
    _, s, c = run("1f1b", p, m)
    assert steady_state(s, c).period == pytest.approx(3 * (m + p - 1))
    # Ranks that slow each other: back to back all of them compute all the
    # time, so every action takes twice as long, and still no rank idles.
    shared = steady_state(schedule, replace(costs, contention=2.0))
    assert shared.period == pytest.approx(6 * m)
    assert shared.bubble_ratio == pytest.approx(0.0, abs=1e-9)


def test_repeat_steps_renames_microbatches():
    schedule = generate("1f1b", 2, 2)
    twice = repeat_steps(schedule, 2)
    assert twice.n_microbatches == 4
    assert [str(a) for a in twice.actions[1]] == [
        "1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3",
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("policy", [None, "eager", "paper", "fill"])
def test_every_schedule_and_policy_runs_and_does_all_work(name, policy):
    p, m = 4, 8
    result, _, _ = run(name, p, m, policy)
    # Every rank computes 3m of unit work whatever the order.
    assert result.busy == pytest.approx((3.0 * m,) * p)
    assert 0 <= result.bubble_ratio < 1
    assert result.makespan >= 3 * m


# -- the bubble table of docs/schedules.md ------------------------------------------------

DOCS = Path(__file__).parents[1] / "docs" / "schedules.md"
POLICIES = {"off": None, "eager": "eager", "paper": "paper"}


def _docs_bubble_table() -> dict[tuple[str, int, str], str]:
    """``(schedule, m, policy) -> cell`` of the table 'Simulated bubble ratios, p = 4'."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Simulated bubble ratios"))
    rows = []
    for line in lines[start + 1 :]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    head, _, *body = rows
    columns = [re.fullmatch(r"m=(\d+) (\w+)", h) for h in head[1:]]
    table = {}
    for row in body:
        for column, cell in zip(columns, row[1:], strict=True):
            assert column is not None, head
            table[(row[0], int(column[1]), column[2])] = cell
    return table


def _closed_form_makespan(name: str, m: int, policy: str) -> float | None:
    """The makespan of ``name`` on p = 4 ranks with unit costs, where a closed form exists.

    Every rank computes 3m; what varies is the wait. ``V`` = 2 stages per rank
    (interleaved-1f1b, zb-v), each stage taking half of F, I, W.

    - off: naive runs each micro-batch alone, 3pm. GPipe and 1F1B fill and
      drain with (p - 1)(F + B) = 3(p - 1); interleaved with 3(p - 1)/V.
      ZB-H1 idles (p - 1)(F + I - W) = p - 1, as do ZB-H2 and ZB-V once
      m >= 2p (their warm-up is then full): 3m + (p - 1) and 3m + (p - 1)/V.
    - eager (W right after its I, so a B that lets its gradient go after I):
      naive (2p + 1)m (a micro-batch takes p F, p I and rank 0's W alone);
      the others fill and drain with (p - 1)(F + I) = 2(p - 1), over V for the
      interleaved and V-shaped ones.
    - paper: GPipe as eager (its W waits to the end anyway); naive ends on the
      last rank, which runs F and I of the last micro-batch from 2p(m - 1) +
      p - 1 on, then one W over all m: (2p + 1)m - (p - 1). The others reach
      ZB-H1's 3m + (p - 1), or 3m + (p - 1)/V with two stages per rank.
    - DualPipeV (m >= 2p) takes ZB-V's time in every column. DualPipe (two
      pipelines, m >= 2p) idles p/2 - 1 as generated and with paper, twice that eager.
    """
    p, v = 4, 2
    per_rank = 3 * m
    fill = {
        "off": {
            "naive": 3 * p * m - per_rank,
            "gpipe": 3 * (p - 1),
            "1f1b": 3 * (p - 1),
            "interleaved-1f1b": 3 * (p - 1) / v,
            "zb-h1": p - 1,
            "zb-h2": p - 1 if m >= 2 * p else None,
            "zb-v": (p - 1) / v if m >= 2 * p else None,
            "dualpipev": (p - 1) / v,
            "dualpipe": p / 2 - 1,
        },
        "eager": {
            "naive": (2 * p + 1) * m - per_rank,
            "gpipe": 2 * (p - 1),
            "1f1b": 2 * (p - 1),
            "interleaved-1f1b": 2 * (p - 1) / v,
            "zb-h1": 2 * (p - 1),
            "zb-h2": 2 * (p - 1),
            "zb-v": 2 * (p - 1) / v,
            "dualpipev": 2 * (p - 1) / v,
            "dualpipe": 2 * (p / 2 - 1),
        },
        "paper": {
            "naive": (2 * p + 1) * m - (p - 1) - per_rank,
            "gpipe": 2 * (p - 1),
            "1f1b": p - 1,
            "interleaved-1f1b": (p - 1) / v,
            "zb-h1": p - 1,
            "zb-h2": p - 1,
            "zb-v": (p - 1) / v,
            "dualpipev": (p - 1) / v,
            "dualpipe": p / 2 - 1,
        },
    }[policy].get(name)  # chimera: no closed form
    return None if fill is None else per_rank + fill


def test_the_bubble_table_of_the_docs_is_what_the_simulator_gives():
    table = _docs_bubble_table()
    assert {k[0] for k in table} == set(SCHEDULES)
    assert len(table) == len(SCHEDULES) * 2 * len(POLICIES)
    without_closed_form = []
    for (name, m, policy), cell in table.items():
        if cell == "-":  # a count the schedule does not take
            with pytest.raises(ValueError, match="at least 2p = 8 micro-batches"):
                generate(name, 4, m)
            continue
        result, _, _ = run(name, 4, m, POLICIES[policy])
        assert cell == f"{100 * result.bubble_ratio:.1f}%", (name, m, policy, result.makespan)
        expected = _closed_form_makespan(name, m, policy)
        if expected is None:
            without_closed_form.append((name, m, policy))
            continue
        assert result.makespan == pytest.approx(expected), (name, m, policy)
        assert cell == f"{100 * bubble(4, m, expected):.1f}%", (name, m, policy)
    # ZB-H2 and ZB-V with m = p cannot fill their warm-up: the table holds what they simulate.
    chimera = [("chimera", m, policy) for m in (4, 8) for policy in ("eager", "off", "paper")]
    assert sorted(without_closed_form) == [*chimera, ("zb-h2", 4, "off"), ("zb-v", 4, "off")]
