"""A Hugging Face LLaMA cut into blocks, its decoder layers compiled: 2BP as in eager mode.

The tiny model of the family (no download), its two decoder-layer blocks compiled
with :func:`~twobp.engine.compiled.compile_for_two_stage` (``aot_eager``, every region
compiled: inductor's C++ build would dominate), each block its own store, a few steps
of two micro-batches: gradients equal those of the same steps in eager mode, the same
routes, no graph break and no new dynamo frame after the third step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from twobp.engine import defer_weight_grads
from twobp.engine.compiled import compile_for_two_stage

transformers = pytest.importorskip("transformers")
from twobp.integrations.transformers import blocks, build_model, loss_function  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

N_MB = 2
STEPS = 4


def _steps(model: nn.Module, compiled: bool) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    parts = blocks(model)
    if compiled:
        for block in list(parts)[1:-1]:
            compile_for_two_stage(block, backend="aot_eager", regions="compiled")
    stores = [defer_weight_grads(b, label=f"block {i}") for i, b in enumerate(parts)]
    loss_fn = loss_function(model)
    frames, breaks = [], sum(counters["graph_break"].values())
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(step)
        batches = [torch.randint(1, 64, (2, 8), generator=gen) for _ in range(N_MB)]
        ran: list[list[tuple[Tensor | None, Tensor]]] = []
        for mb, ids in enumerate(batches):
            x: Any = ids
            ran.append([])
            for i, (block, store) in enumerate(zip(parts, stores, strict=True)):
                leaf = None if i == 0 else x.detach().requires_grad_()
                with store.forward(mb):
                    y = block(ids if leaf is None else leaf)
                    out = loss_fn(y, ids) / N_MB if i == len(parts) - 1 else y
                ran[mb].append((leaf, out))
                x = y
        for mb in range(N_MB):
            grad = None
            for i in reversed(range(len(parts))):
                leaf, out = ran[mb][i]
                got = stores[i].backward_input(mb, [out], [grad], [] if leaf is None else [leaf])
                grad = got[0] if leaf is not None else None
        for store in stores:
            store.backward_weight(range(N_MB))
            store.finish_step()
        frames.append(int(counters["stats"]["unique_graphs"]))
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "routes": [(r.name, r.route) for s in stores for r in s.routes()],
        "frames": frames,
        "breaks": sum(counters["graph_break"].values()) - breaks,
    }


def test_compiled_llama_layers_keep_two_bp() -> None:
    torch.manual_seed(0)
    model = build_model("llama", "tiny")
    eager = _steps(copy.deepcopy(model), compiled=False)
    result = _steps(model, compiled=True)
    for name, grad in eager["grads"].items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert result["routes"] == eager["routes"]
    immediate = [n for n, r in result["routes"] if r.value != "deferred"]
    # Every projection and the embedding deferred; LlamaRMSNorm's weight * x is left to
    # autograd, as in eager mode.
    assert immediate and all(n.endswith("norm.weight") for n in immediate), immediate
    assert len(result["routes"]) - len(immediate) >= 2 * 7 + 2
    assert result["frames"][-1] == result["frames"][2] > eager["frames"][-1]
    assert result["breaks"] == 0
