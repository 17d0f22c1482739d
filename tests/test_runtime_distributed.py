"""The runtime on real process groups (gloo, CPU, float64) against one-process references.

One launch per world size trains every schedule x two_bp x partition x model
(on 4 ranks, one model per schedule x two_bp x partition, in rotation) for a
few AdamW steps and returns losses, first-step gradients and final parameters
and buffers of every rank; the tests compare them here with a single-process
run of the same model. The 2-rank launch also checks the utilities (timeline,
clipping, evaluation, W groups, threads), the 4-rank one loads a 2-rank
checkpoint. Failure tests launch groups of their own.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn

from runtime_models import MODELS, build_blocks, make_batch, per_microbatch, train_reference
from runtime_workers import (
    Case,
    checkpoint_onto_more_ranks,
    rank_killed_mid_step,
    train_cases,
    utilities,
)
from twobp.runtime import LaunchError, launch
from twobp.schedule import SCHEDULES, TWO_BP_POLICIES, generate
from twobp.timeline import bubble_ratio

TOL = 1e-10
N_MB = 4
BATCH = 2 * N_MB
TIMEOUT = 30.0


def _partitions(n_stages: int) -> list[tuple[int, ...] | None]:
    """Uniform and one uneven split of the 10 blocks."""
    uneven = {2: (3, 7), 4: (1, 4, 3, 2), 8: (2, 1, 1, 1, 1, 1, 1, 2)}
    return [None, uneven[n_stages]]


def _microbatches(name: str, n_ranks: int) -> int | None:
    """None where the schedule takes the launch's N_MB; else 2 N_MB (DualPipe's m >= 2p)."""
    try:
        generate(name, n_ranks, N_MB)
    except ValueError:
        return 2 * N_MB
    return None


def _cases(n_ranks: int, models: tuple[str, ...]) -> list[Case]:
    cases = []
    for k, name in enumerate(SCHEDULES):
        m = _microbatches(name, n_ranks)
        n_stages = generate(name, n_ranks, m or N_MB).pipeline_stages
        for two_bp in (False, True):
            for i, partition in enumerate(_partitions(n_stages)):
                for j, model in enumerate(models):
                    # With 4 ranks each (schedule, two_bp, partition) trains one
                    # model, in a rotation that still trains every model with
                    # and without 2BP, to keep the test fast.
                    if n_ranks == 4 and (k + i + 2 * two_bp + j) % len(models) != 0:
                        continue
                    cases.append(Case(model, name, two_bp, partition, n_microbatches=m))
    return cases


# two_bp with one bool per stage of the model: the stages given False run a fused B.
PER_STAGE_CASES = [
    Case("transformer", "1f1b", (False, True)),
    Case("mlp", "1f1b", (True, False), policy="fill"),
    Case("conv", "zb-v", (True, False, True, False)),
    Case("mlp", "interleaved-1f1b", (False, True, True, False)),
    Case("transformer", "chimera", (False, True)),
]
EXTRA_CASES = [
    Case("transformer", "1f1b", True, policy="eager"),
    Case("transformer", "1f1b", True, policy="fill"),
    Case("mlp", "gpipe", True, weight_group_size=1),
    # 1F1B with the paper policy ends with one W over every micro-batch: the cap splits it.
    Case("conv", "1f1b", True, weight_group_size=2),
    # DualPipe's own W placed again by each policy (paper concatenates the last W).
    *(Case("transformer", "dualpipev", True, policy=p, placed=True) for p in TWO_BP_POLICIES),
    *(Case("mlp", "dualpipe", True, policy=p, placed=True) for p in TWO_BP_POLICIES),
    *PER_STAGE_CASES,
]
EXTRA_CASES_4 = [
    Case("transformer", "interleaved-1f1b", True, policy="eager"),
    Case("conv", "1f1b", True, policy="fill"),
    Case("mlp", "gpipe", True, weight_group_size=2),
    Case("mlp", "dualpipev", True, policy="paper", placed=True, n_microbatches=2 * N_MB),
    Case("transformer", "dualpipe", True, policy="fill", placed=True, n_microbatches=2 * N_MB),
]
CASES = {2: _cases(2, MODELS) + EXTRA_CASES, 4: _cases(4, MODELS) + EXTRA_CASES_4}


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def references() -> dict[Any, dict[str, Any]]:
    """By model for N_MB micro-batches, and by (model, m) for the cases of another m
    (the conv model's BatchNorm statistics depend on the micro-batch)."""
    out: dict[Any, dict[str, Any]] = {m: train_reference(m, N_MB, BATCH) for m in MODELS}
    for case in CASES[2] + CASES[4]:
        if _key(case) not in out:
            m = case.n_microbatches or N_MB
            out[_key(case)] = train_reference(case.model, m, BATCH, _replicas(case))
    return out


def _replicas(case: Case) -> int:
    """Copies of every stage whose buffers differ from one process's (Chimera, DualPipe:
    each pipeline updates BatchNorm's statistics on its own micro-batches)."""
    return SCHEDULES[case.schedule].pipelines if per_microbatch(case.model) else 1


def _key(case: Case) -> Any:
    if case.n_microbatches is None and _replicas(case) == 1:
        return case.model
    return (case.model, case.n_microbatches or N_MB, _replicas(case))


# The launcher's parent sees this many cores while starting the two-rank session.
FAKE_CORES = 8


@pytest.fixture(scope="module")
def two_rank_results() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as patch:
        # launch() shares the cores it sees between its ranks (threads_per_rank=None).
        patch.setattr(os, "sched_getaffinity", lambda pid: set(range(FAKE_CORES)), raising=False)
        results = launch(_two_rank_session, 2, CASES[2], N_MB, BATCH, TIMEOUT, timeout=240)
    return [r[0] for r in results], [r[1] for r in results]


def _two_rank_session(
    cases: list[Case], n_mb: int, batch: int, timeout: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    launch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's own cores are shared with the other rank
    trained = train_cases(cases, n_mb, batch, timeout)
    utils = utilities(n_mb, batch, timeout)
    utils["launch threads"] = launch_threads
    return trained, utils


@pytest.fixture(scope="module")
def four_rank_session(tmp_path_factory) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    folder = str(tmp_path_factory.mktemp("four-ranks"))
    return launch(_four_rank_session, 4, CASES[4], N_MB, BATCH, TIMEOUT, folder, timeout=300)


def _four_rank_session(
    cases: list[Case], n_mb: int, batch: int, timeout: float, folder: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    trained = train_cases(cases, n_mb, batch, timeout)
    return trained, checkpoint_onto_more_ranks(folder, n_mb, batch, timeout)


@pytest.fixture(scope="module")
def four_rank_results(four_rank_session) -> list[dict[str, Any]]:
    return [r[0] for r in four_rank_session]


def _check_case(case: Case, per_rank: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    results = [r[str(case)] for r in per_rank]
    for rank, r in enumerate(results):
        for step, (got, want) in enumerate(zip(r["losses"], reference["losses"], strict=True)):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (rank, step, got, want)
    grads: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for r in results:
        # A replicated stage (Chimera) lives on two ranks, which must agree.
        for name in set(grads) & set(r["grads"]):
            torch.testing.assert_close(r["grads"][name], grads[name], rtol=0, atol=TOL)
        for name in set(state) & set(r["state"]):
            torch.testing.assert_close(r["state"][name], state[name], rtol=0, atol=TOL)
        grads.update(r["grads"])
        state.update(r["state"])
    assert set(grads) == set(reference["grads"])
    assert set(state) == set(reference["state"])
    for name, want in reference["grads"].items():
        torch.testing.assert_close(grads[name], want, rtol=0, atol=TOL, msg=f"grad of {name}")
    # With two pipelines, each replica updates BatchNorm's running statistics on its own
    # micro-batches and they average: the reference does the same.
    for name, want in reference["state"].items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=TOL, msg=f"{name} after AdamW")


@pytest.mark.parametrize("case", CASES[2], ids=str)
def test_two_ranks_match_single_process(case, two_rank_results, references):
    _check_case(case, two_rank_results[0], references[_key(case)])


@pytest.mark.parametrize("case", CASES[4], ids=str)
def test_four_ranks_match_single_process(case, four_rank_results, references):
    _check_case(case, four_rank_results, references[_key(case)])


def test_four_ranks_train_every_model_with_and_without_two_bp():
    trained = {(c.model, c.two_bp) for c in CASES[4]}
    assert trained == {(m, b) for m in MODELS for b in (False, True)}
    assert {c.schedule for c in CASES[4]} == set(SCHEDULES)
    assert {c.policy for c in CASES[4]} == {"paper", "eager", "fill"}
    assert any(c.weight_group_size for c in CASES[4])


def test_a_two_rank_checkpoint_loads_onto_four_ranks(four_rank_session):
    outcomes = [r[1] for r in four_rank_session]
    continued = {**outcomes[0]["continued state"], **outcomes[1]["continued state"]}
    loaded: dict[str, torch.Tensor] = {}
    for rank, out in enumerate(outcomes):
        assert out["stages"] == [rank]
        assert not set(loaded) & set(out["loaded state"]), "a tensor on two ranks"
        loaded.update(out["loaded state"])
        # Another number of ranks: every rank gets the extra of rank 0's file.
        assert out["extra"] == {"rank": 0} and out["step count"] == 2
        for got, want in zip(out["loaded losses"], outcomes[0]["continued losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (rank, got, want)
    assert set(loaded) == set(continued)
    for name, want in continued.items():
        torch.testing.assert_close(loaded[name], want, rtol=0, atol=TOL, msg=name)


def test_two_bp_runs_split_schedules(two_rank_results):
    results = two_rank_results[0][0]
    assert "+2bp:paper" in results[str(Case("mlp", "1f1b", True))]["schedule"]
    assert "2bp" not in results[str(Case("mlp", "1f1b", False))]["schedule"]
    assert results[str(Case("mlp", "zb-v", True))]["stages"] == [0, 3]


def test_two_bp_per_stage_splits_only_those_stages(two_rank_results):
    for case in PER_STAGE_CASES:
        assert not isinstance(case.two_bp, bool)
        n_stages = len(case.two_bp)
        split = {s % n_stages for r in two_rank_results[0] for s in r[str(case)]["split"]}
        # The first stage's I directly followed by its W runs as one B (nobody waits for it).
        assert split and split <= {s for s, b in enumerate(case.two_bp) if b}, (case, split)


def _reference_transformer() -> tuple[nn.Module, Any, Any]:
    model = nn.Sequential(*build_blocks("transformer"))
    inputs, targets = make_batch("transformer", 0, BATCH)
    return model, inputs, targets


def test_clip_grad_norm_equals_single_process(two_rank_results):
    utils = two_rank_results[1]
    for norm_type, max_norm, key in ((2.0, 0.05, "2"), (math.inf, 0.001, "_inf")):
        model, inputs, targets = _reference_transformer()
        from runtime_models import reference_step

        reference_step(model, "transformer", inputs, targets, N_MB)
        if key == "_inf":  # the pipeline clipped by the 2-norm first
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
        for u in utils:
            assert math.isclose(u[f"norm{key}"], want, rel_tol=1e-12)
        clipped = {**utils[0][f"clipped{key}"], **utils[1][f"clipped{key}"]}
        for name, p in model.named_parameters():
            torch.testing.assert_close(clipped[name], p.grad, rtol=0, atol=TOL)


def test_eval_step_loss_and_outputs(two_rank_results):
    utils = two_rank_results[1]
    model, inputs, targets = _reference_transformer()
    with torch.no_grad():
        logits = model(inputs)
    from runtime_models import loss_fn

    want = float(loss_fn("transformer")(logits, targets))
    assert [math.isclose(u["eval_loss"], want, abs_tol=TOL) for u in utils] == [True, True]
    assert utils[0]["eval_output"] is None
    torch.testing.assert_close(utils[1]["eval_output"], logits, rtol=0, atol=TOL)


def test_timeline_merges_every_rank_in_the_order_of_its_schedule(two_rank_results):
    utils = two_rank_results[1]
    spans = utils[0]["spans"]
    assert spans == utils[1]["spans"]
    assert {s.rank for s in spans} == {0, 1}
    schedule = utils[0]["schedule"]
    # The runtime runs the compute actions of the lowered schedule, in the schedule's order.
    assert utils[0]["lowered compute"] == schedule == utils[1]["schedule"]
    for rank in (0, 1):
        mine = [s for s in spans if s.rank == rank]
        assert [str(s.action) for s in mine] == schedule[rank]
        assert mine[0].start >= 0 and all(s.start <= s.end for s in mine)
        assert all(b.start >= a.end for a, b in pairwise(mine)), "spans of a rank overlap"
    # 1f1b with 2BP on 2 ranks: every F and I of each micro-batch, and the Ws.
    kinds = [s.action.kind.value for s in spans if s.rank == 0]
    assert kinds.count("F") == N_MB and kinds.count("I") == N_MB and "W" in kinds
    assert 0.0 < bubble_ratio(spans) < 1.0


def test_step_times_count_this_ranks_actions_and_transfers(two_rank_results):
    # 1f1b with 2BP on 2 ranks: rank 0 sends each micro-batch's activation and
    # receives its gradient; rank 1 the other way round.
    for u in two_rank_results[1]:
        times, mine = u["step times"], u["local spans"]
        assert times.compute_actions == len(mine)
        assert times.sends == times.receives == N_MB
        assert times.compute == pytest.approx(sum(s.end - s.start for s in mine))
        assert times.sending > 0 and times.receiving > 0 and times.dispatch >= 0
        assert times.sending + times.receiving + times.dispatch < mine[-1].end


def test_weight_group_size_caps_the_micro_batches_of_every_w(two_rank_results, references):
    # The rows that each weight-gradient product of the MLP's linear layers contracts
    # (2 per micro-batch), 5 linear layers per stage; 1F1B with 2BP (paper) on 2 ranks.
    rank0, rank1 = (u["weight groups"] for u in two_rank_results[1])
    assert rank0["None"]["schedule"][-3:] == ["0W0", "0I3", "0W1-3"]
    assert rank1["None"]["schedule"][-1] == "1W0-3"
    # Uncapped: one product per layer over each W's micro-batches.
    assert Counter(rank0["None"]["rows"]) == {2: 5, 6: 5}
    assert Counter(rank1["None"]["rows"]) == {8: 5}
    # weight_group_size=2: W1-3 runs as W1-2 and W3, W0-3 as W0-1 and W2-3.
    assert Counter(rank0["2"]["rows"]) == {2: 10, 4: 5}
    assert Counter(rank1["2"]["rows"]) == {4: 10}
    want = references["mlp"]["grads"]
    for group in ("None", "2"):
        grads = {**rank0[group]["grads"], **rank1[group]["grads"]}
        assert set(grads) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(grads[name], value, rtol=0, atol=TOL, msg=name)


def test_threads_per_rank_default_to_a_share_of_the_cores(two_rank_results):
    for utils in two_rank_results[1]:
        # launch(): the cores its parent saw, over 2 ranks.
        assert utils["launch threads"] == FAKE_CORES // 2
        # A pipeline built with the defaults: this machine's cores over its 2 local ranks.
        cores, threads = utils["pipeline threads"]
        assert threads == max(1, cores // 2)


def test_load_state_dict_takes_the_local_entries(two_rank_results):
    utils = two_rank_results[1]
    full = nn.Sequential(*build_blocks("conv")).state_dict()
    loaded = {**utils[0]["loaded"], **utils[1]["loaded"]}
    assert set(loaded) == set(full)
    assert not set(utils[0]["loaded"]) & set(utils[1]["loaded"])
    for name, value in full.items():
        torch.testing.assert_close(loaded[name], value + 1)


def test_a_killed_rank_ends_the_others_with_an_error():
    # Rank 0 waits on rank 1 at most 6 s; the launcher gives it 10 s to fail on its own.
    with pytest.raises(LaunchError) as info:
        launch(rank_killed_mid_step, 2, N_MB, 6.0, grace_period=10.0, timeout=120)
    failures = {f.rank: f for f in info.value.failures}
    assert failures[1].message == "killed by SIGKILL"
    # The survivor noticed the closed connection (PeerFailedError), it did not wait out its
    # timeout (PeerTimeoutError).
    assert failures[0].error_type == "PeerFailedError"
    # Rank 0 waited, in 1F1B, for the gradient of micro-batch 0 at its first I.
    assert failures[0].message.startswith("rank 0 at 0I0: communication with rank 1 failed")
    assert "rank 1: killed by SIGKILL" in str(info.value)
