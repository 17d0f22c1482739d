"""Pipelines of compiled blocks keep 2BP: gradients equal eager, no recompilation, W deferred.

One 2-rank launch trains every case twice, compiled and eager (tests/compile_workers.py):
``compile=True`` (inductor), ``aot_eager`` with the recompute modes that rebuild W's stash
and with autocast, and blocks the user compiled with ``torch.compile``. Compile time
dominates: tiny blocks, few steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compile_workers import compiled_cases
from twobp.runtime import PipelineConfigError, launch
from twobp.runtime.setup.compiled_stages import compile_options

# Every stage stays compiled ("stages": "compiled"): these cases check the compiled blocks
# in every step (tests/test_runtime_compile_trial.py checks the choice of the default).
AOT = {"backend": "aot_eager", "regions": "compiled", "stages": "compiled"}
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("inductor", {"compile": {"stages": "compiled"}}, False),
    ("user-compiled", {}, True),
    ("derivatives", {"compile": AOT, "recompute": "derivatives"}, False),
    ("all", {"compile": AOT, "recompute": "all"}, False),
    ("autocast", {"compile": AOT, "autocast": torch.bfloat16}, False),
    ("no-2bp", {"compile": AOT, "two_bp": False}, False),
]
TOL = {"inductor": 1e-5, "autocast": 1e-2}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(compiled_cases, 2, CASES, threads_per_rank=1, timeout=900)


@pytest.mark.timeout(600)  # compile time: inductor and aot_eager in every case on 2 ranks
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_compiled_pipeline_matches_eager(results: list[dict[str, Any]], name: str) -> None:
    tol = TOL.get(name, 1e-6)
    for rank, result in enumerate(results):
        compiled, eager = result[name]
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=tol), rank
        assert compiled["grads"].keys() == eager["grads"].keys()
        assert compiled["grads"]
        for key, grad in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][key], grad, atol=tol, rtol=tol)
        # Dynamo compiled its frames in the first steps (a later case may reuse those of
        # an earlier one); none after the third, no graph break.
        assert compiled["frames"][-1] == compiled["frames"][2], (rank, compiled["frames"])
        assert name != CASES[0][0] or compiled["frames"][0] > 0
        assert compiled["breaks"] == 0, rank
        # W still defers every weight that it defers in eager mode (the gate stays immediate).
        differ = {
            (s, k): (v, eager["routes"].get(s, {}).get(k))
            for s, stage in compiled["routes"].items()
            for k, v in stage.items()
            if eager["routes"].get(s, {}).get(k) != v
        }
        assert compiled["routes"] == eager["routes"], (rank, differ)
        if name != "no-2bp":
            routes = [r for stage in compiled["routes"].values() for r in stage.values()]
            assert routes.count("deferred") > routes.count("immediate") > 0


def test_compile_option_is_checked() -> None:
    assert compile_options(False) is None
    assert compile_options(True) == {}
    assert compile_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    with pytest.raises(PipelineConfigError, match="compile='yes'"):
        compile_options("yes")
    assert compile_options({"regions": "eager"}) == {"regions": "eager"}
    with pytest.raises(PipelineConfigError, match="regions is one of 'measured'"):
        compile_options({"regions": "fast"})
    assert compile_options({"norms": "routed"}) == {"norms": "routed"}
    with pytest.raises(PipelineConfigError, match="norms is one of 'unfolded', 'routed'"):
        compile_options({"norms": "whole"})
    assert compile_options({"stages": "compiled"}) == {"stages": "compiled"}
    with pytest.raises(PipelineConfigError, match="stages is one of 'measured', 'compiled'"):
        compile_options({"stages": "eager"})
