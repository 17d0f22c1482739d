"""``Pipeline(..., compile=True)`` compiles a 2BP stage whole: one graph over its blocks, whose
regions run across the blocks' edges; a fused stage, and one with blocks the user compiled,
block by block (:mod:`twobp.runtime.setup.compiled_stages`)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from compile_workers import uncompiled_warnings
from twobp.engine import defer_weight_grads
from twobp.engine.compiled import is_compiled
from twobp.runtime.setup.compiled_stages import compile_stage

DIM = 8


class PreNorm(nn.Module):
    """``x + fc2(relu(fc1(rms_norm(x))))``: with the norm unfolded, three regions of its own
    (the normalisation, the relu, the residual add)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Gated(PreNorm):
    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.silu(self.fc1(self.norm(x))))


def _stage(*classes: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict((str(i), c()) for i, c in enumerate(classes)))


class _Recorder:
    """A backend that keeps each region's graph and runs it as it is."""

    def __init__(self) -> None:
        self.regions: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.regions.append(gm)
        return gm.forward


def _step(stage: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """One micro-batch's F, I and W through a store: the weight gradients."""
    store = defer_weight_grads(stage)
    for p in stage.parameters():
        p.grad = None
    with store.forward(0):
        out = stage(x)
    store.backward_input(0, [out], [torch.ones_like(out)], [])
    store.backward_weight([0])
    store.finish_step()
    return {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_a_2bp_stage_is_one_graph_whose_regions_cross_the_blocks() -> None:
    torch._dynamo.reset()
    stage, eager = _stage(PreNorm, PreNorm), _stage(PreNorm, PreNorm)
    whole = _Recorder()
    compile_stage(stage, {"backend": whole, "regions": "compiled"}, split=True)
    assert is_compiled(stage) and not any(is_compiled(b) for b in stage)
    x = torch.randn(4, DIM)
    grads = _step(stage, x)
    # 3 regions a block, less one: block 0's residual add and block 1's normalisation
    # are one region.
    assert len(whole.regions) == 5, [len(r.graph.nodes) for r in whole.regions]
    for name, grad in _step(eager, x).items():
        torch.testing.assert_close(grads[name], grad, msg=name)

    torch._dynamo.reset()
    block = _stage(PreNorm)
    one = _Recorder()
    compile_stage(block, {"backend": one, "regions": "compiled"}, split=True)
    _step(block, x)
    assert len(one.regions) == 3


def test_fused_stages_and_user_compiled_blocks_compile_block_by_block() -> None:
    torch._dynamo.reset()
    fused = _stage(PreNorm, PreNorm)
    compile_stage(fused, {"backend": "eager"}, split=False)
    assert not is_compiled(fused) and all(is_compiled(b) for b in fused)

    mixed = _stage(PreNorm, PreNorm)
    mixed[0].compile(backend="eager")
    user = mixed[0]._compiled_call_impl
    compile_stage(mixed, {"backend": "eager", "regions": "compiled"}, split=True)
    assert not is_compiled(mixed) and is_compiled(mixed[1])
    assert mixed[0]._compiled_call_impl is user  # the store makes it keep 2BP


def test_stages_of_the_same_blocks_share_their_compiled_code_and_others_do_not() -> None:
    """Stages of the same classes of blocks run one compiled graph; stages of other blocks
    have a frame of their own, so that they do not count against one code's recompile limit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    stages = [_stage(PreNorm, PreNorm), _stage(PreNorm, PreNorm), _stage(Gated, PreNorm)]
    stages.append(_stage(PreNorm, Gated))
    for stage in stages:
        compile_stage(stage, {"backend": "eager", "regions": "compiled"}, split=True)
    before = counters["stats"]["unique_graphs"]
    x = torch.randn(4, DIM)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("error")  # a frame run uncompiled would warn
        for stage in stages:
            _step(stage, x)
    assert counters["stats"]["unique_graphs"] - before == 3


def test_a_stage_past_the_recompile_limit_is_named_in_the_warning() -> None:
    torch._dynamo.reset()
    stage = _stage(PreNorm, PreNorm)
    compile_stage(stage, {"backend": "eager", "dynamic": False}, split=True)
    store = defer_weight_grads(stage, label="rank 0 stage 1")
    seen = uncompiled_warnings(store, stage, [2, 3], DIM)
    assert [len(w) for w in seen] == [0, 1], seen
    assert seen[1][0].startswith(
        "rank 0 stage 1: the compiled stage (Sequential of 2 blocks) ran uncompiled"
    ), seen[1][0]
