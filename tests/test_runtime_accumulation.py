"""Gradients accumulated over steps without ``zero_grad``, on real gloo ranks, float64.

Two steps in a row must leave the sum of the two steps run alone, for every
parameter, replicated (Chimera, DualPipe, data parallel) and tied ones
included, with 2BP on and off; a step that fails or is skipped between them
must leave the earlier step's gradients as they were.
"""

from __future__ import annotations

from typing import Any

import pytest

from accumulation_workers import accumulate_many
from twobp.runtime import launch

TOL = 1e-10
pytestmark = pytest.mark.usefixtures("torch_one_thread")

TWO = [
    ("tied", "1f1b", True, {}),
    ("tied", "1f1b", False, {}),
    ("tied", "chimera", True, {}),
    ("mlp", "chimera", True, {}),
    ("mlp", "chimera", False, {}),
    ("mlp", "zb-v", True, {}),
    ("tied", "dualpipe", True, {}),
    ("mlp", "dualpipe", False, {}),
]
FOUR = [
    ("mlp", "1f1b", True, {"data_parallel": 2}),
    ("tied", "1f1b", False, {"data_parallel": 2}),
]


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return launch(accumulate_many, 2, TWO, timeout=600)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return launch(accumulate_many, 4, FOUR, timeout=600)


def _gap(got: dict[str, Any], want: dict[str, Any]) -> float:
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max() / (1 + want[n].abs().max())) for n in want)


def _check(results: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    for rank, by_case in enumerate(results):
        r = by_case[repr(case)]
        g1, g2 = r["alone"]
        assert g1, f"rank {rank} holds no gradient"
        summed = {n: g1[n] + g2[n] for n in g1}
        assert _gap(r["after_failure"], g1) < TOL, f"rank {rank}: a failed step touched .grad"
        assert _gap(r["after_skip"], g1) < TOL, f"rank {rank}: a skipped step touched .grad"
        assert _gap(r["together"], summed) < TOL, f"rank {rank}: steps 0 + 1 accumulated"
        assert r["failure"] in ("ValueError", "PeerStepFailedError"), r["failure"]


@pytest.mark.parametrize("case", TWO, ids=repr)
def test_two_steps_add_up_on_two_ranks(two: list[dict[str, Any]], case: tuple[Any, ...]) -> None:
    _check(two, case)


@pytest.mark.parametrize("case", FOUR, ids=repr)
def test_two_steps_add_up_with_data_parallel(
    four: list[dict[str, Any]], case: tuple[Any, ...]
) -> None:
    _check(four, case)


def test_a_skipped_step_is_recorded(two: list[dict[str, Any]]) -> None:
    assert [r[repr(TWO[3])]["skipped"] for r in two] == [[3], [3]]
