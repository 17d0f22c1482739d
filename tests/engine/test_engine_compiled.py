"""The engine on compiled modules: the store defers and concatenates W as in eager mode.

One model class (tests/compile_workers.Block: a norm, a linear, a weight read through
its transpose, a gate left to autograd, an RMS norm compiled unfolded) compiled every
way a user compiles it: ``torch.compile(model)``, ``block.compile()`` in place, and
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
import torch.nn.functional as F
from torch import Tensor, fx, nn

import twobp.engine.compiled as engine_compiled
from twobp.engine import defer_weight_grads
from twobp.engine.compiled import (
    FrameCodes,
    SplittingBackend,
    _joins_a_region,
    compile_for_two_stage,
    routed_calls,
    split_at_routed_calls,
)
from twobp.engine.ops.norm import rms_norm_affine
from twobp.engine.region_choice import RegionChoice, prefer_compiled
from twobp.engine.unfolded_norms import NORM_MODES, unfold_rms_norms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile_workers import DIM, Block, uncompiled_warnings

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
    "compile_for_two_stage": lambda m: compile_for_two_stage(
        m, backend="aot_eager", regions="compiled"
    ),
    "inductor": lambda m: compile_for_two_stage(m, regions="compiled"),
    "measured": lambda m: compile_for_two_stage(m, backend="aot_eager"),
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
            for p in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down", "out_norm.weight")
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
    assert kept[0] >= 2 * 4 * 2  # 2 blocks x (norm, up, down, out_norm) x (input, output grad)


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
    assert names == ["__matmul__", "layer_norm", "linear", "mul", "rms_norm", "t"]
    kept = [n for n in gm.graph.nodes if n.op.startswith("call") and n not in routed]
    assert [getattr(n.target, "__name__", n.target) for n in kept] == ["gelu", "add"]


def test_rms_norm_unfolds_into_the_region_before_it() -> None:
    """The RMS norm's normalisation joins the residual add's region; only its weight
    product is routed (as F.rms_norm's deferred op); ``norms="routed"`` keeps it whole."""
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(copy.deepcopy(_model()[0]), backend=keep)(torch.randn(2, DIM))
    ops = {}
    for norms in NORM_MODES:
        gm, inputs = graphs[0]
        choices: list[RegionChoice] = []
        split_at_routed_calls(
            fx.GraphModule(gm, copy.deepcopy(gm.graph)), inputs, keep, "compiled", choices, norms
        )
        ops[norms] = [c.ops for c in choices]
    # The residual add's region gains x * x, mean, + eps, rsqrt and x * rstd.
    assert ops["unfolded"] == [*ops["routed"][:-1], ops["routed"][-1] + 5]
    gm, inputs = graphs[0]
    routed = routed_calls(gm, inputs)
    (affine,) = unfold_rms_norms(gm, routed)
    assert affine.args[1] == (DIM,) and "out_norm" in affine.args[2].name
    assert F.rms_norm not in routed.values() and rms_norm_affine in routed.values()
    assert SplittingBackend().norms == "unfolded"
    with pytest.raises(ValueError, match="norms='whole'"):
        SplittingBackend(norms="whole")  # type: ignore[arg-type]


class _Head(nn.Module):
    """A model's final norm and output projection, as a pipeline's last block: the norm
    reads the block's input, with nothing else to compute beside it (unless ``before``)."""

    def __init__(self, before: str = "") -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.out = nn.Linear(DIM, DIM)
        self.before = before

    def forward(self, x: Tensor) -> Tensor:
        if self.before == "add":
            x = x + 1.0
        elif self.before == "dropout":  # a random draw: the regions keep the source order
            x = F.dropout(x, 0.25)
        y = self.out(self.norm(x))
        return F.dropout(y, 0.25) if self.before == "dropout after" else y


def _graph(module: nn.Module) -> tuple[fx.GraphModule, list[Any]]:
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(module, backend=keep)(torch.randn(2, DIM))
    return graphs[0]


@pytest.mark.parametrize(
    ("before", "regions"),
    [("", []), ("add", [1 + 5]), ("dropout", [1 + 5]), ("dropout after", [1])],
)
def test_a_norm_with_nothing_beside_it_stays_routed_whole(before: str, regions: list[int]) -> None:
    """Unfolded alone, a head's norm would be a compiled region of its own (which costs more
    than the eager norm): it stays routed whole, and the head has no region at all. With a
    call before it (in reordered or in source order), its normalisation joins that one's;
    in source order a call after the routed ones does not take it in."""
    gm, inputs = _graph(_Head(before))
    routed = routed_calls(gm, inputs)
    made = unfold_rms_norms(gm, routed, _joins_a_region(gm, routed))
    assert len(made) == (1 if before in ("add", "dropout") else 0)
    gm, inputs = _graph(_Head(before))
    choices: list[RegionChoice] = []
    keep: Callable[..., Any] = lambda g, _: g.forward  # noqa: E731
    split_at_routed_calls(gm, inputs, keep, "compiled", choices)
    assert [c.ops for c in choices] == regions


def test_a_compiled_head_has_eager_s_gradients_and_coverage() -> None:
    torch.manual_seed(0)
    eager = _train(nn.Sequential(_Head()))
    torch.manual_seed(0)
    compiled = _train(compile_for_two_stage(nn.Sequential(_Head()), regions="compiled"))
    for key, grad in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][key], grad, atol=1e-5, rtol=1e-5)
    assert compiled["report"] == eager["report"]
    assert compiled["deferred"] == {"0.norm.weight", "0.out.weight", "0.out.bias"}
    assert compiled["early"] == set()


class _Projections(nn.Module):
    """Two projections of one input, each followed by its own activation: in source order
    the regions interleave with the routed calls."""

    def __init__(self, random: bool = False) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.wk = nn.Linear(DIM, DIM)
        self.wo = nn.Linear(DIM, DIM)
        self.random = random

    def forward(self, x: Tensor) -> Tensor:
        q = torch.relu(self.wq(x))
        if self.random:
            q = torch.nn.functional.dropout(q, 0.5)
        k = torch.tanh(self.wk(x))
        return self.wo(q * k) + x


def _regions(module: nn.Module) -> list[RegionChoice]:
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(module, backend=keep)(torch.randn(2, DIM))
    choices: list[RegionChoice] = []
    split_at_routed_calls(*graphs[0], keep, "compiled", choices)
    return choices


def test_independent_routed_calls_share_a_region() -> None:
    """wq and wk run one after the other: relu, tanh and the product are one region (not
    two); a random draw keeps the source order (three regions)."""
    assert [c.ops for c in _regions(_Projections())] == [3, 1]
    assert [c.ops for c in _regions(_Projections(random=True))] == [2, 2, 1]


def test_regions_are_measured_once() -> None:
    """Every region of a measured graph is timed on its first call and runs the faster way."""
    assert prefer_compiled(1.0, 0.5) and not prefer_compiled(1.0, 0.99)
    backend = SplittingBackend("aot_eager")
    model = _Projections()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    store = defer_weight_grads(compiled)
    x = torch.randn(2, DIM)
    for _ in range(2):
        with store.forward(0):
            out = compiled(x)
        store.backward_input(0, [out], [torch.ones_like(out)], [])
        store.backward_weight([0])
        store.finish_step()
    eager(x).sum().mul(2).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert [c.ops for c in backend.choices] == [3, 1]
    for choice in backend.choices:
        assert choice.mode in ("compiled", "eager")
        assert choice.eager_s and choice.compiled_s
        assert (choice.mode == "compiled") == prefer_compiled(choice.eager_s, choice.compiled_s)
    with pytest.raises(ValueError, match="regions='fast'"):
        SplittingBackend(regions="fast")  # type: ignore[arg-type]


class _Shaped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc(x))


def test_a_block_past_the_recompile_limit_warns_once() -> None:
    """Past dynamo's recompile limit a frame runs uncompiled (its weight gradients in I):
    one warning names the block and says what to do."""
    stage = nn.Sequential(nn.Linear(DIM, DIM), _Shaped())
    compile_for_two_stage(stage[1], backend="eager", dynamic=False)
    store = defer_weight_grads(stage, label="stage 1")
    seen = uncompiled_warnings(store, stage, [2, 3, 4], DIM)
    assert [len(w) for w in seen] == [0, 1, 0], seen
    assert seen[1][0].startswith("stage 1: the compiled block '1' (_Shaped) ran")
    assert "recompile_limit = 1" in seen[1][0]
    assert "dynamic=True" in seen[1][0]


def test_frame_codes_keep_the_most_recently_used_under_names_never_reused() -> None:
    codes = FrameCodes(size=2)
    template = _Shaped.forward.__code__
    linear, relu, gelu = ((nn.Sequential, c) for c in (nn.Linear, nn.ReLU, nn.GELU))
    a = codes.code(linear, template)
    b = codes.code(relu, template)
    assert codes.code(linear, template) is a  # a hit: relu's is now the oldest
    c = codes.code(gelu, template)
    assert len(codes) == 2 and relu not in codes
    assert codes.code(linear, template) is a
    again = codes.code(relu, template)  # made anew, under a name no code had; gelu's goes
    assert again is not b and gelu not in codes
    assert len({a.co_name, b.co_name, c.co_name, again.co_name}) == 4
    codes.clear()
    assert len(codes) == 0 and codes.code(linear, template) is not a


def _store_grads(stage: nn.Module, x: Tensor) -> list[Tensor | None]:
    """One micro-batch's F, I and W through a store: each parameter's gradient."""
    store = defer_weight_grads(stage)
    with store.forward(0):
        out = stage(x)
    store.backward_input(0, [out], [torch.ones_like(out)], [])
    store.backward_weight([0])
    store.finish_step()
    return [p.grad for p in stage.parameters()]


def test_a_stage_whose_frame_code_was_forgotten_compiles_again_with_eager_s_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With room for one frame code, a stage of other blocks takes the first stage's place;
    a stage like the first then gets a code of its own again, and all three keep the
    gradients of plain autograd in float64."""
    codes = FrameCodes(size=1)
    monkeypatch.setattr(engine_compiled, "FRAME_CODES", codes)
    torch.manual_seed(0)
    x = torch.randn(3, DIM, dtype=torch.float64, requires_grad=True)
    first, other, again = (
        nn.Sequential(nn.Linear(DIM, DIM), last).double()
        for last in (nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    )
    keys = [(nn.Sequential, nn.Linear, type(s[1])) for s in (first, other, again)]
    present = []
    for stage in (first, other, again):
        plain = copy.deepcopy(stage)
        plain(x).sum().backward()
        compile_for_two_stage(stage, backend="aot_eager", regions="compiled", dynamic=False)
        got = _store_grads(stage, x)
        for ours, reference in zip(got, plain.parameters(), strict=True):
            torch.testing.assert_close(ours, reference.grad)
        present.append([key in codes for key in keys[:2]])
    assert present == [[True, False], [False, True], [True, False]]
