"""Stacked expert weights: their W is deferred and concatenated per expert over micro-batches.

Three ways experts are written (``grouped_mm`` with offsets, one expert's
slice ``w[e]`` into ``F.linear``, ``bmm`` over the experts dimension), with a
router, in micro-batches where some expert gets no token: gradients equal
plain autograd's (float64, 1e-10) over every W plan, and the report counts
every weight deferred.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from engine_harness import assert_matches, compare_with_autograd, plan_f_i_w, randn, seeded
from torch import Tensor, nn

from twobp.engine import defer_weight_grads
from twobp.engine.capture import running_capture
from twobp.engine.coverage import Route, deferred_share
from twobp.engine.ops.experts import grouped_product

EXPERTS, DIM, HIDDEN, TOP_K = 4, 8, 8, 2


class Routed(nn.Module):
    """A router and SwiGLU-less experts ``[E, out, in]``; ``style`` says how they multiply."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, DIM)
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), TOP_K)
        # Expert 1 never gets a token: the router's choice of it goes to the last.
        chosen = torch.where(chosen == 1, EXPERTS - 1, chosen)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = tokens[order // TOP_K]
        counts = torch.bincount(flat, minlength=EXPERTS)
        if self.style == "grouped_mm":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = _grouped_mm(rows, self.up.transpose(-2, -1), offs)
            y = _grouped_mm(torch.tanh(h), self.down.transpose(-2, -1), offs)
        elif self.style == "select":
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                h = torch.tanh(F.linear(rows[start : start + n], self.up[e]))
                parts.append(F.linear(h, self.down[e]))
                start += n
            y = torch.cat(parts)
        else:  # bmm: every expert over every token, weighted by a dense routing
            h = torch.tanh(torch.bmm(tokens.expand(EXPERTS, -1, -1), self.up.mT))
            dense = torch.bmm(h, self.down.mT)
            gate = torch.zeros(tokens.shape[0], EXPERTS, dtype=x.dtype)
            gate = gate.scatter(1, chosen, weights.to(x.dtype))
            return (dense * gate.t()[:, :, None]).sum(0).reshape(x.shape)
        out = torch.zeros_like(tokens)
        y = (y * weights.reshape(-1)[order, None]).to(out.dtype)
        out = out.index_add(0, order // TOP_K, y)
        return out.reshape(x.shape)


STYLES = ["grouped_mm", "select", "bmm"]


def _grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm`` under the capture; the reference (and float64, which the
    kernel refuses) runs plain per-expert products."""
    if running_capture() is not None:
        return torch._grouped_mm(x, w, offs=offs)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, ends, strict=True))])


def _x(mb: int) -> list[tuple[Tensor, bool]]:
    return [(randn(2, 3, DIM, seed=mb), True)]


def test_grouped_product_equals_torch_grouped_mm() -> None:
    x, w = torch.randn(7, 4), torch.randn(3, 4, 8)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # expert 1 empty, row 6 past the end
    ours = grouped_product(x, w, offs)
    torch.testing.assert_close(ours[:6], torch._grouped_mm(x, w, offs=offs)[:6])
    assert ours[6].abs().max() == 0


@pytest.mark.parametrize("style", STYLES)
def test_expert_gradients_equal_autograd_with_an_expert_without_tokens(style: str) -> None:
    store = assert_matches(seeded(lambda: Routed(style)), _x, n=4)
    routes = {r.name: r for r in store.routes()}
    for name in ("router.weight", "up", "down"):
        assert routes[name].route is Route.DEFERRED, routes[name]
        assert not routes[name].partly_immediate, routes[name]
    assert deferred_share(store.routes()) == 1.0
    # The report counts the experts whose W is concatenated over the micro-batches.
    expected = {"grouped_mm": "grouped_mm per expert x4", "select": "F.linear per expert x4"}
    if style in expected:
        assert re.search(rf"\n +down +{expected[style]} in", store.report()), store.report()
        # The same count, structured: one product per expert of its 4.
        assert routes["down"].expert_products == 4, routes["down"]
        assert routes["router.weight"].expert_products == 0


def test_select_makes_one_op_per_expert_concatenated_over_microbatches() -> None:
    module = seeded(lambda: Routed("select"))()
    comparison, store = compare_with_autograd(module, _x, plan_f_i_w(3, [("W", (0, 1, 2))]))
    assert comparison.worst() <= 1e-10
    names = [op.name for op in store._ops()]
    assert sum(n == "F.linear of up" for n in names) == EXPERTS  # expert 1: zero rows


@pytest.mark.parametrize("style", STYLES)
def test_bfloat16_autocast_matches_autograd(style: str) -> None:
    torch.manual_seed(0)
    module = Routed(style)
    reference = Routed(style)
    reference.load_state_dict(module.state_dict())
    store = defer_weight_grads(module)
    xs = [torch.randn(2, 3, DIM, generator=torch.Generator().manual_seed(m)) for m in range(3)]
    for mb, x in enumerate(xs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with store.forward(mb):
                out = module(x)
            ref = reference(x)
        store.backward_input(mb, [out], [torch.ones_like(out)], [])
        ref.float().sum().backward()
    store.backward_weight([2, 1, 0])
    store.finish_step()
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=2e-2, rtol=2e-2, msg=name)
