"""A region compiled by inductor runs its two compiled graphs from a plain autograd Function
where nothing of AOTAutograd's runtime wrappers applies, and through them elsewhere; either
way with the gradients of eager mode (:mod:`twobp.engine.lean_regions`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

import twobp.engine.compiled as engine_compiled
from twobp.engine import defer_weight_grads, lean_regions
from twobp.engine.compiled import SplittingBackend
from twobp.engine.lean_regions import compile_region
from twobp.engine.lru import LruCache


def _inductor() -> Any:
    from torch import _TorchCompileInductorWrapper

    return _TorchCompileInductorWrapper(None, None, False, None)  # type: ignore[no-untyped-call]


def _compiled(fn: Callable[..., Any], inner: Any = None) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` compiled by dynamo, its one graph by :func:`compile_region`; what that returned."""
    made: list[Any] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        made.append(compile_region(gm, example_inputs, inner or _inductor()))
        return made[-1]

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=False), made


def _grads(fn: Callable[..., Any], loss: Callable[..., Tensor], *inputs: Tensor) -> list[Any]:
    for t in inputs:
        t.grad = None
    loss(*fn(*inputs)).backward()
    return [None if t.grad is None else t.grad.clone() for t in inputs]


def _inputs(*shape: int, grad: tuple[bool, ...] = (True, True, True)) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen, requires_grad=g) for g in grad]


def _region(a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Three outputs: one only of inputs that need no gradient, one not differentiable."""
    return F.silu(a) * b + c, (a * c).sum(-1), (b > 0)


def _loss(h: Tensor, s: Tensor, mask: Tensor) -> Tensor:
    # h's gradient arrives expanded from one number (not the layout the backward graph was
    # traced with).
    return h.sum() * 3 + s.pow(2).sum() + mask.sum()


@pytest.mark.parametrize("grad", [(True, True, True), (True, False, True), (False, True, False)])
def test_a_lean_region_has_eager_s_gradients(grad: tuple[bool, ...]) -> None:
    compiled, made = _compiled(_region)
    inputs = _inputs(4, 6, grad=grad)
    got = _grads(compiled, _loss, *inputs)
    assert len(made) == 1 and getattr(made[0], "_twobp_lean", False)
    for ours, eager in zip(got, _grads(_region, _loss, *inputs), strict=True):
        if eager is None:
            assert ours is None
        else:
            torch.testing.assert_close(ours, eager)
    # Under no_grad (a recomputed forward, evaluation) the same graph serves as compiled.
    with torch.no_grad():
        for ours, eager in zip(made[0](*inputs), _region(*inputs), strict=True):
            torch.testing.assert_close(ours, eager)


def _view_of_input(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return a.t(), a * b


def _in_place(a: Tensor, b: Tensor) -> tuple[Tensor]:
    b.mul_(2)
    return (a * b,)


def test_regions_that_need_aot_s_wrappers_run_through_them() -> None:
    compiled, made = _compiled(_view_of_input)
    a, b = _inputs(4, 6, grad=(True, True))

    def loss(*outs: Tensor) -> Tensor:
        return sum(o.pow(2).sum() for o in outs)  # type: ignore[return-value]

    got = _grads(compiled, loss, a, b)
    assert not getattr(made[0], "_twobp_lean", False)
    for ours, eager in zip(got, _grads(_view_of_input, loss, a, b), strict=True):
        torch.testing.assert_close(ours, eager)

    compiled, made = _compiled(_in_place)
    a, b = _inputs(4, 6, grad=(True, False))
    b2 = b.clone()
    out = compiled(a, b)[0]
    assert not getattr(made[0], "_twobp_lean", False)
    torch.testing.assert_close(b, b2 * 2)
    torch.testing.assert_close(out, a * b2 * 2)

    compiled, made = _compiled(_region)
    with torch.autocast("cpu", torch.bfloat16):
        compiled(*_inputs(4, 6))
    assert not getattr(made[0], "_twobp_lean", False)


def test_other_backends_compile_their_regions_themselves() -> None:
    seen: list[fx.GraphModule] = []

    def recorder(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(gm)
        return gm.forward

    compiled, made = _compiled(_region, recorder)
    compiled(*_inputs(4, 6))
    assert len(seen) == 1 and not getattr(made[0], "_twobp_lean", False)


class _Block(nn.Module):
    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))) * self.scale)


def _stage_pair(*scales: float) -> tuple[nn.Module, nn.Module, Any, SplittingBackend]:
    """Blocks of these scales, twice from one seed: eagerly, and compiled whole (every region
    compiled by inductor); the eager stage, the module, its compiled call, the backend."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(*(_Block(c) for c in scales))
    torch.manual_seed(0)
    backend = SplittingBackend(_inductor(), regions="compiled")
    module = nn.Sequential(*(_Block(c) for c in scales))
    return eager, module, torch.compile(module, backend=backend), backend


def _backward(store: Any, out: Tensor) -> None:
    """I and W of micro-batch 0, whose F gave ``out``, and the step's end."""
    store.backward_input(0, [out], [torch.ones_like(out)], [])
    store.backward_weight([0])
    store.finish_step()


def _same_grads(module: nn.Module, eager: nn.Module) -> None:
    for (name, p), q in zip(module.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_compiled_stage_s_regions_run_lean_and_keep_eager_s_gradients() -> None:
    eager, module, stage, backend = _stage_pair(2.0, 2.0)
    store = defer_weight_grads(stage)
    x = torch.randn(4, 8, requires_grad=True)  # a stage after the first
    with store.forward(0):
        out = stage(x)
    _backward(store, out)
    eager(x).sum().backward()
    _same_grads(module, eager)
    assert backend.choices and all(c.lean for c in backend.choices), backend.choices


def _stage_step(*scales: float) -> tuple[list[Any], nn.Module, nn.Module]:
    """A stage of blocks with these scales compiled whole, one micro-batch's F, I and W
    through it and plain autograd's backward through the eager blocks: each region's
    compiled call, the module and the eager blocks."""
    eager, module, stage, _ = _stage_pair(*scales)
    calls: list[Any] = []
    real = lean_regions.compile_region

    def spy(gm: fx.GraphModule, example_inputs: list[Any], inner: Any) -> Any:
        calls.append(real(gm, example_inputs, inner))
        return calls[-1]

    engine_compiled.compile_region = spy  # type: ignore[attr-defined]
    try:
        store = defer_weight_grads(stage)
        x = torch.randn(4, 8, requires_grad=True)
        with store.forward(0):
            out = stage(x)
    finally:
        engine_compiled.compile_region = real  # type: ignore[attr-defined]
    _backward(store, out)
    eager(x).sum().backward()
    return calls, module, eager


def test_repeated_regions_of_a_stage_are_compiled_once() -> None:
    """Block 1's regions are block 0's (but the first, which also holds block 0's residual
    add): compiled once, called from each; a region that differs by a constant is not."""
    calls, module, eager = _stage_step(2.0, 2.0)
    assert len(calls) == 5 and calls[1] is calls[3]
    assert len({id(c) for c in calls}) == 4
    _same_grads(module, eager)
    calls, module, eager = _stage_step(2.0, 3.0)
    assert calls[1] is not calls[3]
    _same_grads(module, eager)


def test_a_stage_recompiled_with_symbolic_sizes_keeps_eager_s_gradients() -> None:
    """Dynamo's automatic dynamic shapes: a second batch size recompiles the stage with
    symbolic sizes, whose regions (tensors only, of symbolic shapes) neither run lean nor
    reuse compiled code; the gradients stay eager's."""
    eager, module, stage, backend = _stage_pair(2.0, 2.0)  # dynamic=None: automatic
    store = defer_weight_grads(stage)
    for rows in (4, 5):
        for m in (module, eager):
            m.zero_grad(set_to_none=True)
        x = torch.randn(rows, 8, requires_grad=True)
        with store.forward(0):
            out = stage(x)
        _backward(store, out)
        eager(x).sum().backward()
        _same_grads(module, eager)
    assert len(backend.choices) == 10
    assert all(c.lean for c in backend.choices[:5]) and not any(c.lean for c in backend.choices[5:])


def _other_region(a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.tanh(a) * c - b, (b * c).sum(-1), (a > 0)


def test_a_region_forgotten_by_the_cache_is_compiled_again_with_eager_s_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With room for one compiled region, another region takes the first one's place; the
    first, compiled again, still computes what plain autograd does in float64, and a
    region found in the cache is the one compiled before."""
    monkeypatch.setattr(lean_regions, "COMPILED_REGIONS", LruCache(1))
    inputs = [t.detach().double().requires_grad_() for t in _inputs(4, 6)]
    made = []
    for fn in (_region, _other_region, _region, _region):
        compiled, regions = _compiled(fn)
        got = _grads(compiled, _loss, *inputs)
        (region,) = regions
        for ours, eager in zip(got, _grads(fn, _loss, *inputs), strict=True):
            torch.testing.assert_close(ours, eager)
        for ours, eager in zip(compiled(*inputs), fn(*inputs), strict=True):
            torch.testing.assert_close(ours, eager)
        assert len(lean_regions.COMPILED_REGIONS) == 1
        made.append(region)
    assert made[2] is not made[0]  # forgotten when the other region came: compiled again
    assert made[3] is made[2]  # kept since: found
