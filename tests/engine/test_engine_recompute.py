"""Derivative checkpointing in the store: an I that keeps no stash, a W that rebuilds it."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from engine_harness import randn, seeded
from torch import Tensor, nn

from twobp.engine import TwoStageBackwardError, defer_weight_grads
from twobp.engine.stash import CONCAT_ROWS

N_MB = 4


class Gated(nn.Module):
    """A linear layer (deferred), dropout, and a gate that autograd serves during I."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.out = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.dropout(torch.tanh(self.fc(x)), 0.3, training=True)
        return self.out(h * self.gate)


def _run(module: nn.Module, keep_stash: bool, group_size: int | None, rows: int = 4) -> list:
    """F of every micro-batch, I in reverse, one W: the input gradients."""
    store = defer_weight_grads(module)
    inputs = [randn(rows, 5, seed=mb).requires_grad_() for mb in range(N_MB)]
    grads = [randn(rows, 3, seed=10 + mb) for mb in range(N_MB)]
    states, outputs = {}, {}
    torch.manual_seed(3)
    for mb in range(N_MB):
        states[mb] = torch.get_rng_state()
        with store.forward(mb):
            outputs[mb] = module(inputs[mb])
    input_grads = [
        store.backward_input(mb, [outputs[mb]], [grads[mb]], [inputs[mb]], keep_stash=keep_stash)
        for mb in reversed(range(N_MB))
    ]
    if not keep_stash:
        assert all(b == 0 for b in store.stashed_bytes().values())

    def rebuild(mb: int) -> tuple[Sequence[Tensor], Sequence[Tensor]]:
        now = torch.get_rng_state()
        torch.set_rng_state(states[mb])
        try:
            return [module(inputs[mb])], [grads[mb]]
        finally:
            torch.set_rng_state(now)

    store.backward_weight(range(N_MB), group_size, rebuild=None if keep_stash else rebuild)
    store.finish_step()
    return input_grads


@pytest.mark.parametrize("group_size", [None, 1, 3])
def test_a_rebuilt_stash_gives_the_same_gradients(group_size):
    kept = seeded(Gated)()
    rebuilt = copy.deepcopy(kept)
    want = _run(kept, True, group_size)
    got = _run(rebuilt, False, group_size)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[0], w[0])
    # The gate (served by autograd during I) is not counted twice; the deferred ones once.
    for (name, p), q in zip(kept.named_parameters(), rebuilt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_without_a_cap_w_rebuilds_a_group_of_concat_rows_at_a_time(monkeypatch):
    module = seeded(Gated)()
    store_rows = []
    from twobp.engine import store as store_module

    original = store_module.WeightGradStore._weight_pass

    def record(self, chunk):
        store_rows.append(sum(self._stash_rows(mb) for mb in chunk))
        original(self, chunk)

    monkeypatch.setattr(store_module.WeightGradStore, "_weight_pass", record)
    _run(module, False, None, rows=CONCAT_ROWS // 2)
    assert store_rows == [CONCAT_ROWS, CONCAT_ROWS]


def test_w_of_a_dropped_stash_without_rebuild_is_refused():
    module = seeded(Gated)()
    store = defer_weight_grads(module)
    x = randn(4, 5, seed=0).requires_grad_()
    with store.forward(0):
        y = module(x)
    store.backward_input(0, [y], [torch.ones_like(y)], [x], keep_stash=False)
    with pytest.raises(TwoStageBackwardError, match=r"W0: .*keep_stash=False; pass rebuild="):
        store.backward_weight([0])
    assert store.pending_weight() == (0,)
