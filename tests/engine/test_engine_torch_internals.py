"""The torch internals of the compiled engine, behind one adapter
(:mod:`twobp.engine.torch_internals`): an internal missing from the installed torch is
named, with the torch found and what to do, where it is reached."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo.eval_frame
import torch.nn.functional as F
from torch import Tensor, fx, nn

from twobp.engine import lean_regions, torch_internals
from twobp.engine.compiled import compile_for_two_stage, keep_two_stage
from twobp.engine.torch_internals import CHECKED_ON, MissingTorchInternalError


def _says_what_to_do(error: pytest.ExceptionInfo[MissingTorchInternalError], where: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    assert f"torch's internal {where}, which torch {torch.__version__} does not have" in message
    assert f"checked on torch {CHECKED_ON}" in message
    assert "compile=False" in message and f"install torch {CHECKED_ON}" in message


def test_a_missing_function_of_dynamo_is_named_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = torch.compile(nn.Linear(2, 2), backend="aot_eager")
    monkeypatch.delattr(torch._dynamo.eval_frame, "innermost_backend")
    with pytest.raises(MissingTorchInternalError) as error:
        keep_two_stage(module)
    _says_what_to_do(error, "torch._dynamo.eval_frame.innermost_backend")


def test_a_missing_attribute_of_a_dynamo_context_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = torch.compile(nn.Linear(2, 2), backend="aot_eager")
    monkeypatch.delattr(module.dynamo_ctx, "_dynamic")
    with pytest.raises(MissingTorchInternalError) as error:
        keep_two_stage(module)
    _says_what_to_do(error, "OptimizeContext._dynamic")


def test_a_missing_inductor_wrapper_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_TorchCompileInductorWrapper")
    with pytest.raises(MissingTorchInternalError) as error:
        compile_for_two_stage(nn.Linear(2, 2))
    _says_what_to_do(error, "torch._TorchCompileInductorWrapper")
    # Where the check is cheap, nothing of torch's is reached before it is needed.
    assert torch_internals.inductor_settings(object()) is None


def _region(a: Tensor, b: Tensor) -> Tensor:
    return F.silu(a) * b


def test_a_region_whose_aot_metadata_torch_lacks_runs_through_aot_s_wrappers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AOTAutograd's metadata is read only to call a region's graphs directly: without it,
    the region runs as inductor returned it, with the gradients of plain autograd. (Torch
    itself imports the metadata's classes, so their absence is simulated in the adapter.)"""

    def missing() -> None:
        raise MissingTorchInternalError("torch has no OutputType here")

    monkeypatch.setattr(torch_internals, "aot_non_alias_output", missing)
    lean_regions.COMPILED_REGIONS.clear()  # so that the region is compiled here
    made: list[Any] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        inductor = torch_internals.inductor_backend(None, None, False)
        made.append(lean_regions.compile_region(gm, example_inputs, inductor))
        return made[-1]

    torch._dynamo.reset()
    compiled = torch.compile(_region, backend=backend, dynamic=False)
    a, b = (torch.randn(4, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    compiled(a, b).pow(2).sum().backward()
    got = a.grad, b.grad
    a.grad = b.grad = None
    _region(a, b).pow(2).sum().backward()
    assert len(made) == 1 and not getattr(made[0], "_twobp_lean", False)
    torch.testing.assert_close(got, (a.grad, b.grad))
