"""two_bp_policy="dynamic" on real process groups (gloo, CPU, float64).

W runs wherever a rank meets a wait at run time, so which W ran where depends on
the timing; what must not: every W runs exactly once, and the results equal one
process's (losses, first-step gradients, state after 3 AdamW steps) and the
static ``paper`` policy's (1e-12 relative). One launch per world size trains
every case; a 3-rank launch holds one gradient back until a W ran in a wait,
so the step completes only if the runtime fills waits.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dynamic_weights_workers import DynamicCase, auto_dynamic, gated_wait, rows_of, session
from runtime_models import N_STEPS, build_blocks, make_batch, reference_step
from twobp.runtime import launch
from twobp.runtime.execution.dynamic_weights import EarlyReductions
from twobp.schedule import Action, Kind, apply_two_bp, generate
from twobp.schedule.two_bp import places_weights_at_run_time

TOL = 1e-10
EXACT = 1e-12
N_MB = 4
BATCH = 2 * N_MB
TIMEOUT = 60.0

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
SCHEDULES_4 = ("1f1b", "zb-h1", "interleaved-1f1b")
CASES_2 = [
    *(
        DynamicCase(m, s, p)
        for s in SCHEDULES
        for m in ("mlp", "transformer")
        for p in ("dynamic", "paper")
    ),
    DynamicCase("tied", "1f1b"),
    DynamicCase("tied", "1f1b", "paper"),
    *(DynamicCase("mlp", s) for s in ("gpipe", "zb-h2", "chimera")),
    DynamicCase("mlp", "dualpipev", n_microbatches=2 * N_MB),
    DynamicCase("mlp", "dualpipe", n_microbatches=2 * N_MB),
    DynamicCase("mlp", "1f1b", recompute="activations"),
    DynamicCase("mlp", "1f1b", recompute="derivatives"),
    DynamicCase("mlp", "1f1b", rows=(8, 12, 4)),
    # A stash bound: apply_two_bp(..., "dynamic", memory_limit=2) lists the W it forces.
    DynamicCase("mlp", "1f1b", n_microbatches=8, stash_limit=2, rows=(16,) * 3),
]
CASES_4 = [
    *(DynamicCase("mlp", s, p) for s in SCHEDULES_4 for p in ("dynamic", "paper")),
    *(DynamicCase(m, "1f1b", data_parallel=2) for m in ("mlp", "tied")),
    DynamicCase("transformer", "zb-v", data_parallel=2),
    DynamicCase("mlp", "interleaved-1f1b", data_parallel=2, rows=(16,) * 3, n_microbatches=4),
]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _reference(case: DynamicCase) -> dict[str, Any]:
    """Losses, first-step gradients and final state of one process (3 AdamW steps)."""
    model = torch.nn.Sequential(*build_blocks(case.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    n_mb = case.n_microbatches or N_MB
    for step, rows in enumerate(rows_of(case, BATCH)):
        inputs, targets = make_batch(case.model, step, rows)
        losses.append(reference_step(model, case.model, inputs, targets, n_mb))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "state": model.state_dict()}


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, Any]]]:
    return {
        2: launch(session, 2, CASES_2, N_MB, BATCH, TIMEOUT, timeout=300),
        4: launch(session, 4, CASES_4, N_MB, BATCH, TIMEOUT, timeout=300),
    }


def _merged(per_rank: list[dict[str, Any]], case: DynamicCase, key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rank in per_rank:
        out.update(rank[str(case)][key])
    return out


def _check(per_rank: list[dict[str, Any]], case: DynamicCase) -> None:
    want = _reference(case)
    for rank in per_rank:
        got = rank[str(case)]
        assert len(got["losses"]) == N_STEPS
        for g, w in zip(got["losses"], want["losses"], strict=True):
            assert math.isclose(g, w, rel_tol=0, abs_tol=TOL), (g, w)
    grads = _merged(per_rank, case, "grads")
    assert set(grads) == set(want["grads"])
    for name, g in grads.items():
        torch.testing.assert_close(g, want["grads"][name], rtol=0, atol=TOL, msg=name)
    state = _merged(per_rank, case, "state")
    for name, value in state.items():
        torch.testing.assert_close(value, want["state"][name], rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("case", CASES_2, ids=str)
def test_two_ranks_match_one_process(case, results):
    _check(results[2], case)


@pytest.mark.parametrize("case", CASES_4, ids=str)
def test_four_ranks_match_one_process(case, results):
    _check(results[4], case)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_dynamic_equals_paper(schedule, model, results):
    _equal_to_paper(results[2], model, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES_4)
def test_dynamic_equals_paper_on_four_ranks(schedule, results):
    _equal_to_paper(results[4], "mlp", schedule)


def _equal_to_paper(per_rank: list[dict[str, Any]], model: str, schedule: str) -> None:
    dynamic = _merged(per_rank, DynamicCase(model, schedule), "grads")
    paper = _merged(per_rank, DynamicCase(model, schedule, "paper"), "grads")
    assert set(dynamic) == set(paper)
    for name, g in dynamic.items():
        scale = max(paper[name].abs().max().item(), 1e-300)
        assert (g - paper[name]).abs().max().item() <= EXACT * scale, name


def test_the_runtime_ran_w_in_waits_and_counted_them(results):
    for per_rank in results.values():
        for name in per_rank[0]:
            if " dynamic" not in name:
                continue
            ranks = [r[name] for r in per_rank]
            assert all("+2bp:dynamic" in r["schedule"] for r in ranks), name
    # 1F1B on 2 ranks: stage 1 waits for every activation after its first I.
    counts = results[2][1][str(DynamicCase("mlp", "1f1b"))]["counts"]
    assert counts["weights_in_waits"] > 0 and counts["weight_seconds_in_waits"] > 0
    static = results[2][1][str(DynamicCase("mlp", "1f1b", "paper"))]["counts"]
    assert static["weights_in_waits"] == 0


def test_a_w_runs_in_the_wait_that_needs_it():
    """Stage 2 sends micro-batch 1's gradient only once stage 1 ran a W in a wait."""
    per_rank = launch(gated_wait, 3, "dynamic", N_MB, BATCH, TIMEOUT, timeout=120)
    assert per_rank[1]["counts"]["weights_in_waits"] > 0
    want = _reference(DynamicCase("mlp", "1f1b"))["grads"]
    grads = {n: g for r in per_rank for n, g in r["grads"].items()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=TOL, msg=name)


def test_the_dynamic_schedule_lists_w_only_where_forced_and_at_the_end():
    base = generate("1f1b", 4, 8)
    dynamic = apply_two_bp(base, "dynamic")
    assert places_weights_at_run_time(dynamic)
    assert not places_weights_at_run_time(apply_two_bp(base, "paper"))
    for acts in dynamic.actions.values():
        weights = [a.kind is Kind.BACKWARD_WEIGHT for a in acts]
        assert all(weights[weights.index(True) :]), acts
    # A memory limit forces W into the list where a rank would hold more.
    limited = apply_two_bp(base, "dynamic", memory_limit=4)
    assert any(
        a.kind is Kind.BACKWARD_WEIGHT and i < len(acts) - 4
        for acts in limited.actions.values()
        for i, a in enumerate(acts)
    )


def test_a_reduction_starts_early_only_once_its_stage_is_done_and_in_list_order():
    acts = [
        Action.make(s, k, m)
        for s, k, m in [
            (3, "I", 0),
            (1, "I", 0),
            (3, "I", 1),
            (1, "I", 1),
            (3, "W", (0, 1)),
            (3, "R", (0, 1)),
            (1, "W", (0, 1)),
            (1, "R", (0, 1)),
        ]
    ]
    early = EarlyReductions(acts)
    assert early.ready(3, {(3, 0)}) == []  # stage 3's W of micro-batch 1 has not run
    # Stage 1's W ran, but its R comes after stage 3's in the list: both wait for it.
    assert early.ready(3, {(1, 0), (1, 1)}) == []
    assert early.ready(2, {(3, 0), (3, 1)}) == []  # stage 3's last I has not run
    assert early.ready(3, {(3, 0), (3, 1), (1, 0), (1, 1)}) == [3]  # stage 1: its I1 runs
    assert early.ready(4, {(3, 0), (3, 1), (1, 0), (1, 1)}) == [1]
    assert early.started == {5, 7}
    later = EarlyReductions(acts)
    assert later.ready(6, {(1, 0), (1, 1)}) == [1]  # stage 3's R started at its place


def test_auto_with_the_dynamic_policy_searches_schedules_with_w_at_run_time():
    per_rank = launch(auto_dynamic, 2, N_MB, BATCH, timeout=300)
    choice = per_rank[0]["choice"]
    assert per_rank[0]["ranked"] == {"dynamic", "off"}, per_rank[0]["ranked"]
    ran = per_rank[0]["schedule"]
    assert ("+2bp:dynamic" in ran) == (choice.policy == "dynamic"), ran
    want = _reference(DynamicCase("mlp", "1f1b"))["grads"]
    grads = {n: g for r in per_rank for n, g in r["grads"].items()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=TOL, msg=name)


def test_a_stash_bound_is_kept_by_the_w_it_lists(results):
    bounded = DynamicCase("mlp", "1f1b", n_microbatches=8, stash_limit=2, rows=(16,) * 3)
    per_rank = [r[str(bounded)] for r in results[2]]
    assert any(r["w listed before an I"] for r in per_rank)
    assert all(r["schedule"].count("+2bp:dynamic") == 1 for r in per_rank)
    assert not any(r[str(DynamicCase("mlp", "1f1b"))]["w listed before an I"] for r in results[2])


def test_a_marked_buffer_tells_when_the_data_is_in():
    from twobp.runtime.communication.channel import _Marks

    pattern = torch.arange(1, 9, dtype=torch.uint8)
    values, mask = torch.empty(3, 4, dtype=torch.float64), torch.empty(2, dtype=torch.bool)
    marks = _Marks([values, mask], pattern)
    assert not marks.arrived()
    values.copy_(torch.randn(3, 4, dtype=torch.float64))
    assert not marks.arrived()  # the mask has not come yet
    mask.fill_(True)
    assert marks.arrived()
    # A message ending in the pattern reads as not there: the receive then waits.
    again = _Marks([values], pattern)
    values.view(-1).view(torch.uint8)[-8:].copy_(pattern)
    assert not again.arrived()
