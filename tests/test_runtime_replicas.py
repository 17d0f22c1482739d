"""Replicated stages on real gloo ranks, float64, against one process on the global batch.

Data-parallel copies of every schedule (2 x 2 ranks), Chimera and DualPipe
(their two pipelines hold a replica of every stage), and a weight tied across
ranks (a token embedding read again by the output head); each trains 3 AdamW
steps and must match, loss, every gradient and every parameter, one process
running the whole global batch. Then the mistakes: a world that is not D x P,
Chimera with an odd P or m, DualPipe(V) with too few micro-batches or an odd P,
a mesh with other dim names, copies with batches of other sizes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from replica_workers import (
    N_MB,
    PART,
    POSTED,
    adamw_across_copies,
    errors,
    groups_around_a_pipeline,
    late_reduction,
    load_tied,
    save_and_load,
    train_many,
    unequal_parts,
)
from runtime_models import build_blocks, make_batch, train_reference
from twobp.runtime import launch
from twobp.schedule import SCHEDULES

TOL = 1e-10
pytestmark = pytest.mark.usefixtures("torch_one_thread")

FOUR = [
    *[
        ("mlp", name, two_bp, {"data_parallel": 2})
        for name in SCHEDULES
        for two_bp in (False, True)
    ],
    ("tied", "1f1b", True, {"data_parallel": 2}),
    ("tied", "chimera", True, {"data_parallel": 2}),
    ("tied", "dualpipe", True, {"data_parallel": 2}),
    ("mlp", "zb-h1", True, {"mesh_shape": (2, 2)}),
    # BatchNorm's running statistics: averaged over 2 copies, and over 4 replicas.
    ("conv", "1f1b", True, {"data_parallel": 2}),
    ("conv", "chimera", True, {"data_parallel": 2}),
    # Recomputation in copies of a pipeline.
    ("mlp", "zb-h1", True, {"data_parallel": 2, "recompute": "all"}),
]
TWO = [
    ("tied", "1f1b", True, {}),
    ("tied", "zb-h1", True, {}),
    ("tied", "1f1b", False, {}),
    ("tied", "chimera", True, {}),
    ("mlp", "chimera", True, {"n_microbatches": 8}),
    # DualPipe's tied weight lives on both ranks twice (two pipelines); DualPipeV's on rank 0.
    ("tied", "dualpipe", True, {}),
    ("tied", "dualpipe", False, {"n_microbatches": 8}),
    ("tied", "dualpipev", True, {}),
    ("conv", "chimera", False, {}),
    # Recomputation with Chimera's replicas and a tied weight.
    ("tied", "chimera", True, {"recompute": "all"}),
    ("tied", "1f1b", True, {"recompute": "derivatives"}),
]
BAD = [
    {"data_parallel": 3},
    {"schedule": "chimera", "n_microbatches": 3},
    {"schedule": "chimera", "data_parallel": 2},
    {"mesh_names": ("a", "b")},
    {"schedule": "dualpipev", "n_microbatches": 3},
    {"schedule": "dualpipe", "n_microbatches": 6, "data_parallel": 2},
]


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[Any]:
    folder = str(tmp_path_factory.mktemp("tied"))
    return launch(_four, 4, folder, timeout=600)


def _four(folder: str) -> tuple[dict[str, Any], str, dict[str, Any], dict[str, Any], Any]:
    saved = save_and_load(folder)
    across = adamw_across_copies(f"{folder}/adamw")
    return train_many(FOUR), unequal_parts(), saved, load_tied(folder), across


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[Any]:
    return launch(_two, 2, str(tmp_path_factory.mktemp("late")), timeout=600)


def _two(folder: str) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    return train_many(TWO), errors(BAD), late_reduction(folder)


_REFERENCES: dict[tuple[str, int, int, int], dict[str, Any]] = {}


def _reference(model: str, copies: int, n_mb: int, replicas: int) -> dict[str, Any]:
    key = (model, copies, n_mb, replicas)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_reference(model, n_mb * copies, PART * copies, replicas)
    return _REFERENCES[key]


def _check(case: tuple[str, str, bool, dict[str, Any]], results: list[dict[str, Any]]) -> None:
    model, schedule, _, options = case
    copies = options.get("data_parallel", options.get("mesh_shape", (1,))[0])
    # Each copy of a stage updates BatchNorm's statistics on its own micro-batches.
    replicas = copies * SCHEDULES[schedule].pipelines
    reference = _reference(model, copies, options.get("n_microbatches", N_MB), replicas)
    grads: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(results):
        for got, want in zip(r["losses"], reference["losses"], strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=TOL), (case, rank, got, want)
        for name, grad in r["grads"].items():
            torch.testing.assert_close(
                grad, reference["grads"][name], rtol=0, atol=TOL, msg=f"{case} rank {rank} {name}"
            )
            grads[name] = grad
        for name, value in r["state"].items():
            torch.testing.assert_close(
                value, reference["state"][name], rtol=0, atol=TOL, msg=f"{case} {name} after AdamW"
            )
    assert set(grads) == set(reference["grads"]), case
    norm = torch.stack([g.norm() ** 2 for g in reference["grads"].values()]).sum().sqrt()
    for r in results:
        assert math.isclose(r["norm"], float(norm), rel_tol=1e-12), case
    # eval_step(x): each copy's outputs of its own batch, on one rank of the copy.
    trained = torch.nn.Sequential(*build_blocks(model))
    trained.load_state_dict(reference["state"])
    trained.eval()  # as the pipeline's blocks for eval_step
    inputs, _ = make_batch(model, 0, PART * copies)
    with torch.no_grad():
        want = trained(inputs)
    given = [(r["dp"][0], r["outputs"]) for r in results if r["outputs"] is not None]
    assert sorted(d for d, _ in given) == list(range(copies)), case
    for d, outputs in given:
        torch.testing.assert_close(outputs, want[d * PART : (d + 1) * PART], rtol=0, atol=TOL)


@pytest.mark.parametrize("case", FOUR, ids=repr)
def test_two_copies_of_two_ranks_match_one_process_on_the_global_batch(case, four):
    _check(case, [r[0][repr(case)] for r in four])


def test_each_rank_knows_its_copy_and_reduces_after_its_last_weight_gradient(four):
    results = [r[0][repr(FOUR[1])] for r in four]  # naive with 2BP
    assert [r["dp"] for r in results] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert [r["ends"] for r in results] == [(True, False), (False, True)] * 2
    # Under Chimera both ranks of a copy run a first and a last stage.
    chimera = [r[0][repr(("tied", "chimera", True, {"data_parallel": 2}))] for r in four]
    assert all(r["ends"] == (True, True) for r in chimera)
    for r in results:
        rows = [line.split(": ", 1)[1].split() for line in r["schedule"].splitlines()[1:]]
        for row in rows:
            for stage in {a[0] for a in row}:
                own = [a for a in row if a[0] == stage and a[1] in "WBR"]
                assert own[-1].startswith(f"{stage}R"), row


def test_copies_passing_batches_of_other_sizes_step_together(four):
    # Each copy's micro-batches are weighted by their share of the global batch's rows.
    said = {r[1] for r in four}
    assert len(said) == 1 and said.pop().startswith("loss "), [r[1] for r in four]


@pytest.mark.parametrize("case", TWO, ids=repr)
def test_two_ranks_with_tied_weights_and_chimera_match_one_process(case, two):
    _check(case, [r[0][repr(case)] for r in two])


def test_a_tied_weight_is_listed_and_stored_once_under_its_first_name(two):
    results = [r[0][repr(TWO[0])] for r in two]  # 1f1b: embedding on rank 0, head on rank 1
    assert "0.tokens.weight" in results[1]["names"]
    assert "9.out.weight" not in results[1]["names"]
    assert "9.out.weight" not in results[1]["state"]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (0, r"group of 2 ranks does not form 3 copies"),
        (1, r"chimera needs an even number of micro-batches.*got 3"),
        (2, r"chimera needs an even number of ranks.*got 1"),
        (3, r"mesh= must be a 2-D DeviceMesh with dims \('dp', 'pp'\).*got dims \('a', 'b'\)"),
        (4, r"PipelineConfigError: .*dualpipev needs at least 2p = 4 micro-batches on 2 ranks"),
        (5, r"PipelineConfigError: .*dualpipe needs an even number of ranks.*got 1"),
    ],
)
def test_bad_replica_options_fail_clearly_on_every_rank(two, index, message):
    import re

    for r in two:
        assert re.search(message, r[1][index]), r[1][index]


def test_a_checkpoint_stores_each_replica_once_and_loads_onto_other_copies(four):
    saved: dict[str, torch.Tensor] = {}
    for r in four:
        for name, value in r[2]["state"].items():
            if name in saved:  # the copies agree
                torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
            saved[name] = value
    manifest = json.loads((Path(four[0][2]["path"]) / "manifest.json").read_text())
    assert (
        "model.9.out.weight" not in manifest["tensors"]
        and "9.out.weight" not in manifest["tensors"]
    )
    assert "0.tokens.weight" in manifest["tensors"]
    loaded: dict[str, torch.Tensor] = {}
    for r in four:  # one pipeline over the 4 ranks, no copies
        loaded.update(r[3]["state"])
    assert set(loaded) == set(saved)
    for name, value in loaded.items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)


EIGHT = ("mlp", "chimera", True, {"data_parallel": 2})


def _eight() -> dict[str, Any]:
    return train_many([EIGHT])


def test_two_copies_of_chimera_on_four_ranks_each_match_one_process():
    # Model stage k is held by 4 ranks: k and 3-k of each copy.
    results = launch(_eight, 8, timeout=600)
    _check(EIGHT, [r[repr(EIGHT)] for r in results])


def test_a_later_pipeline_shares_the_groups_of_the_same_reductions():
    results = launch(groups_around_a_pipeline, 2, timeout=120)
    # The blocks did not change (no optimizer step): both give one process's first loss.
    want = _reference("tied", 1, N_MB, 1)["losses"][0]
    for before, built, again, first, second in results:
        assert built > before  # the tied weight's reduction has a group of its own
        assert again == built
        assert math.isclose(first, want, rel_tol=0, abs_tol=TOL)
        assert math.isclose(second, want, rel_tol=0, abs_tol=TOL)


def test_r_starts_the_reduction_and_the_rank_goes_on_with_its_next_action(two):
    # Rank 1 holds back the R that rank 0's 3R2-3 reduces with until rank 0 has run
    # 0W0-1 (see late_reduction): rank 0 posts it and goes on ...
    rank0, rank1 = (r[2] for r in two)
    assert rank1["seen"]["waited for"] == POSTED
    # ... and waits for it at the step's end.
    assert rank0["seen"]["late rank at the end"]
    want = _reference("mlp", 1, N_MB, 1)["grads"]
    grads = {**rank0["grads"], **rank1["grads"]}
    assert set(grads) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(grads[name], value, rtol=0, atol=TOL, msg=name)


def test_adamw_state_saved_by_two_copies_goes_on_in_one_pipeline_over_all_ranks(four):
    # 2 AdamW steps in 2 copies of 2 ranks, saved; the third in one pipeline of 4 ranks
    # loaded from it (the moments and step counts of every parameter): one process's 3.
    want = _reference("mlp", 2, N_MB, 1)["state"]
    state: dict[str, torch.Tensor] = {}
    for r in four:
        state.update(r[4])
    assert set(state) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=TOL, msg=name)
