"""The weight pass: concatenation only up to CONCAT_ROWS, shared inputs, B without a stash."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_harness import TOL, compare_with_autograd, randn, seeded
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from twobp.engine import defer_weight_grads
from twobp.engine.stash import CONCAT_ROWS, SharedRows, row_chunks


def _stashes(*rows: int) -> list[tuple[Tensor, ...]]:
    return [(torch.zeros(r, 3), torch.zeros(r, 2)) for r in rows]


def test_row_chunks_close_a_group_once_it_has_enough_rows():
    stashes = _stashes(5, 5, 20, 40, 3)
    groups = row_chunks(stashes, row_size=3, min_rows=10)
    assert [len(g) for g in groups] == [2, 1, 1, 1]
    assert [len(g) for g in row_chunks(_stashes(CONCAT_ROWS, 1), row_size=3)] == [1, 1]
    assert row_chunks([], row_size=3) == []


def test_shared_rows_are_reused_by_the_next_layer_only():
    a, b = randn(4, 3, seed=0), randn(4, 3, seed=1)
    shared = SharedRows()
    shared.next_layer()
    first = shared.cat([a, b], (3,))
    assert torch.equal(first, torch.cat([a, b]))
    shared.next_layer()
    assert shared.cat([a, b], (3,)) is first  # the next layer reads the same input
    shared.next_layer()
    shared.next_layer()  # a layer that did not use it drops it
    assert shared.cat([a, b], (3,)) is not first
    assert shared.cat([a], (3,)) is a  # one tensor: no copy, nothing kept


class Attention(nn.Module):
    """Three projections of one normalised input, as in a LLaMA block."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return x + self.q(h) * torch.tanh(self.k(h)) + self.v(h)


@pytest.mark.parametrize("rows", [(2, 3), (CONCAT_ROWS + 5, 1)])
def test_weight_pass_over_small_and_large_stashes_is_exact(rows):
    """Small stashes are concatenated, large ones not; the gradients are the same."""
    n = 4

    def inputs(mb):
        return [(randn(rows[mb % 2], 5, 6, seed=mb), True)]

    schedule = [("F", m) for m in range(n)] + [("I", m) for m in range(n)]
    schedule.append(("W", tuple(range(n))))
    comparison, _ = compare_with_autograd(seeded(Attention)(), inputs, schedule)
    assert comparison.worst() <= TOL, comparison


def test_full_backward_adds_weight_gradients_at_once_and_stashes_nothing():
    def inputs(mb):
        return [(randn(3, 4, 6, seed=mb), True)]

    schedule = [("F", 0), ("B", 0), ("F", 1), ("I", 1), ("F", 2), ("B", 2), ("W", (1,))]
    comparison, store = compare_with_autograd(seeded(Attention)(), inputs, schedule, steps=2)
    assert comparison.worst() <= TOL, comparison

    module = seeded(Attention)()
    store = defer_weight_grads(module)
    x = randn(3, 4, 6, seed=0).requires_grad_()
    with store.forward(0):
        y = module(x)
    store.backward_full(0, [y], [torch.ones_like(y)], [x])
    assert store.stashed_bytes() == {0: 0}
    assert store.pending_weight() == ()
    assert all(p.grad is not None for p in module.parameters())
    store.finish_step()


class _HeavyOps(TorchDispatchMode):
    """Records every matrix product and convolution run inside it: (op, operand shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.rstrip("_") in ("mm", "addmm", "bmm", "baddbmm") or "conv" in name:
            shapes = [tuple(a.shape) for a in args if isinstance(a, Tensor)]
            self.calls.append((name, shapes))
        return func(*args, **(kwargs or {}))


def _conv_then_linear() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5), nn.Tanh(), nn.Linear(5, 4),
    )  # fmt: skip


@pytest.mark.parametrize(("group_size", "groups"), [(None, 1), (2, 2), (1, 4)])
def test_weight_pass_is_one_concatenated_operation_per_layer(group_size, groups):
    """A W over 4 micro-batches of 3 samples runs one product per layer and group."""
    n, samples = 4, 3
    module = seeded(_conv_then_linear)()
    reference = copy.deepcopy(module)
    store = defer_weight_grads(module)
    inputs = [randn(samples, 2, 4, 4, seed=mb) for mb in range(n)]
    grads = [randn(samples, 4, seed=100 + mb) for mb in range(n)]
    for mb in range(n):
        with store.forward(mb):
            out = module(inputs[mb])
        store.backward_input(mb, [out], [grads[mb]], [])
    with _HeavyOps() as ops:
        store.backward_weight(range(n), weight_group_size=group_size)
    store.finish_step()

    rows = samples * n // groups  # samples of one group
    conv = [shapes for name, shapes in ops.calls if "conv" in name]
    products = [shapes for name, shapes in ops.calls if "conv" not in name]
    # The convolution: one weight-gradient op per group over all its samples.
    assert len(conv) == groups, ops.calls
    assert all(shapes[0][0] == rows for shapes in conv), ops.calls
    # The two linear layers: one product each per group, contracting all its rows.
    assert len(products) == 2 * groups, ops.calls
    for shapes in products:
        left, right = shapes[-2:]
        assert left[-1] == right[-2] == rows, ops.calls

    for mb in range(n):
        reference(inputs[mb]).backward(grads[mb])
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL, msg=name)
