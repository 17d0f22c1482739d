"""The engine on compiled modules: the store defers and concatenates W as in eager mode.

One model class (tests/compile_workers.Block: a norm, a linear, a weight read through
its transpose, a gate left to autograd) compiled every way a user compiles it:
``torch.compile(model)``, ``block.compile()`` in place, and
:func:`twobp.engine.compiled.compile_for_two_stage`, once with inductor. Compile time
dominates: the compiled models are built once per module (fixtures) and shared.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, fx, nn

from twobp.engine import defer_weight_grads
from twobp.engine.compiled import compile_for_two_stage, routed_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile_workers import DIM, Block

N_MB = 3
STEPS = 5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _train(model: nn.Module, autocast: bool = False) -> dict[str, Any]:
    """STEPS steps of N_MB micro-batches through a store; grads checked None after I."""
    store = defer_weight_grads(model)
    frames, breaks = [], _breaks()
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(2, 3, DIM, generator=gen, requires_grad=True) for _ in range(N_MB)]
        outs = []
        for mb, x in enumerate(xs):
            with store.forward(mb), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                outs.append(model(x).float())
        for mb in range(N_MB):
            store.backward_input(mb, [outs[mb]], [torch.ones_like(outs[mb])], [xs[mb]])
        deferred = {n for n, _ in store.deferred_parameters()}
        early = {n for n, p in model.named_parameters() if p.grad is not None}
        store.backward_weight(range(N_MB))
        store.finish_step()
        frames.append(_frames())
    return {
        "grads": {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()},
        "routes": [(r.name.replace("_orig_mod.", ""), r.route) for r in store.routes()],
        "early": {n.replace("_orig_mod.", "") for n in early},
        "deferred": {n.replace("_orig_mod.", "") for n in deferred},
        "frames": frames,
        "breaks": _breaks() - breaks,
        "report": store.report(),
        "store": store,
    }


def _plain(model: nn.Module) -> dict[str, Tensor]:
    """The last step's gradients by plain autograd."""
    for p in model.parameters():
        p.grad = None
    gen = torch.Generator().manual_seed(STEPS - 1)
    xs = [torch.randn(2, 3, DIM, generator=gen, requires_grad=True) for _ in range(N_MB)]
    sum(model(x).sum() for x in xs).backward()  # type: ignore[union-attr]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


COMPILERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "torch.compile": lambda m: torch.compile(m, backend="aot_eager"),
    "in place": lambda m: (m.compile(backend="aot_eager"), m)[1],
    "compile_for_two_stage": lambda m: compile_for_two_stage(m, backend="aot_eager"),
    "inductor": lambda m: compile_for_two_stage(m),
}


@pytest.fixture(scope="module")
def eager() -> dict[str, Any]:
    return _train(_model())


@pytest.fixture(scope="module", params=list(COMPILERS))
def compiled(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, _train(COMPILERS[request.param](_model()))


def test_compiled_store_matches_eager(
    eager: dict[str, Any], compiled: tuple[str, dict[str, Any]]
) -> None:
    name, result = compiled
    tol = 1e-5 if name == "inductor" else 1e-6
    assert result["grads"].keys() == eager["grads"].keys()
    for key, grad in eager["grads"].items():
        torch.testing.assert_close(result["grads"][key], grad, atol=tol, rtol=tol)
    plain = _plain(_model())
    for key, grad in plain.items():
        torch.testing.assert_close(result["grads"][key], grad, atol=1e-5, rtol=1e-5)
    # The same coverage as eager: every weight deferred, the gate left to autograd.
    assert result["routes"] == eager["routes"]
    if name != "torch.compile":  # whose parameter names start with _orig_mod.
        assert result["report"] == eager["report"]
    assert (
        result["deferred"]
        == eager["deferred"]
        == {
            f"{b}.{p}"
            for b in (0, 1)
            for p in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down")
        }
    )
    # W deferred: after every I only the gate had its gradient.
    assert result["early"] == eager["early"] == {"0.gate", "1.gate"}
    # No dynamo frame after the third step, no graph break.
    assert result["frames"][-1] == result["frames"][2]
    assert result["breaks"] == 0


def _stashes_then_w(store: Any) -> list[int]:
    """One more step: the tensors kept per micro-batch between all I and the one W."""
    model = store._module
    xs = [torch.randn(2, 3, DIM, requires_grad=True) for _ in range(N_MB)]
    for mb, x in enumerate(xs):
        with store.forward(mb):
            out = model(x)
        store.backward_input(mb, [out], [torch.ones_like(out)], [x])
    kept = [len(store.stashed_tensors(mb)) for mb in range(N_MB)]
    store.backward_weight(range(N_MB))
    assert all(store.stashed_tensors(mb) == [] for mb in range(N_MB))
    store.finish_step()
    return kept


def test_compiled_store_concatenates_w(
    eager: dict[str, Any], compiled: tuple[str, dict[str, Any]]
) -> None:
    """Every deferred call stashes as in eager mode until one W over all micro-batches."""
    _, result = compiled
    kept = _stashes_then_w(result["store"])
    assert kept == _stashes_then_w(eager["store"])
    assert kept[0] >= 2 * 3 * 2  # 2 blocks x (norm, up, down) x (input, output gradient)


def test_compiled_module_outside_a_store_is_plain_autograd() -> None:
    model = COMPILERS["compile_for_two_stage"](_model())
    reference = _plain(_model())
    got = _plain(model)
    for key, grad in reference.items():
        torch.testing.assert_close(got[key], grad)


def test_compiled_store_under_autocast() -> None:
    eager = _train(_model(), autocast=True)
    result = _train(COMPILERS["compile_for_two_stage"](_model()), autocast=True)
    for key, grad in eager["grads"].items():
        torch.testing.assert_close(result["grads"][key], grad, atol=1e-2, rtol=1e-2)
    assert result["routes"] == eager["routes"]
    assert result["frames"][-1] == result["frames"][2]


def test_routed_calls_are_the_reads_of_parameters() -> None:
    """Which calls of a dynamo graph run through the capture: reads of parameters and of
    their views; everything else stays in the compiled regions."""
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        return gm.forward

    block = copy.deepcopy(_model()[0])
    torch.compile(block, backend=keep)(torch.randn(2, DIM))
    gm, inputs = graphs[0]
    routed = routed_calls(gm, inputs)
    names = sorted(getattr(f, "__name__", str(f)) for f in routed.values())
    assert names == ["__matmul__", "layer_norm", "linear", "mul", "t"]
    kept = [n for n in gm.graph.nodes if n.op.startswith("call") and n not in routed]
    assert [getattr(n.target, "__name__", n.target) for n in kept] == ["gelu", "add"]
