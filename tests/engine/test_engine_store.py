"""The store's contract beyond gradient values: plain paths, misuse, memory, report."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_harness import TOL, randn, seeded
from torch import nn
from torch.utils.checkpoint import checkpoint

from twobp.engine import TwoStageBackwardError, WeightGradStore, defer_weight_grads


def _mlp() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)))()


def _forward(store: WeightGradStore, module: nn.Module, mb: int):
    x = randn(4, 5, seed=mb).requires_grad_()
    with store.forward(mb):
        y = module(x)
    return x, y


def _input_pass(store: WeightGradStore, mb: int, x, y):
    return store.backward_input(mb, [y], [torch.ones_like(y)], [x])


def test_forward_outside_store_forward_is_plain_autograd():
    module = _mlp()
    reference = copy.deepcopy(module)
    store = defer_weight_grads(module)
    x = randn(4, 5, seed=0)
    y = module(x)
    assert "DeferredWeightFunction" not in type(y.grad_fn).__name__
    y.sum().backward()
    reference(x).sum().backward()
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert store.stashed_bytes() == {}


def test_no_grad_inside_store_forward_records_nothing():
    module = _mlp()
    store = defer_weight_grads(module)
    x = randn(4, 5, seed=0)
    with torch.no_grad(), store.forward(0):
        y = module(x)
    assert y.grad_fn is None
    assert torch.equal(y, copy.deepcopy(module)(x).detach())
    store.finish_step()  # nothing pending


def test_store_forward_uses_the_deferred_function():
    module = _mlp()
    store = defer_weight_grads(module)
    _, y = _forward(store, module, 0)
    assert type(y.grad_fn).__name__ == "DeferredWeightFunctionBackward"


def test_the_direct_apply_and_the_wrapper_build_the_same_graph():
    from twobp.engine import deferred

    # On the pinned torch the deferred ops skip Function.apply's Python wrapper.
    assert deferred.DIRECT_APPLY is not None
    module = _mlp()
    store = defer_weight_grads(module)
    _forward(store, module, 9)  # makes the deferred ops
    op = store._capture.ops[0]
    x = randn(4, 5, seed=0).requires_grad_()
    params = [o.param for o in op.operands]
    with store.forward(0):
        direct = deferred.apply_function(op, 0, (None, None), x, *params)
    with store.forward(1):
        wrapped = deferred.DeferredWeightFunction.apply(op, 1, (None, None), x, *params)
    assert torch.equal(direct, wrapped)
    assert type(direct.grad_fn) is type(wrapped.grad_fn)
    (gd,) = store.backward_input(0, [direct.sum()], [None], [x])
    (gw,) = store.backward_input(1, [wrapped.sum()], [None], [x])
    assert torch.equal(gd, gw)
    # Both handed their stash to the store, each under its own micro-batch.
    assert {0, 1} <= set(store.stashed_bytes())
    assert store.stashed_bytes()[0] > 0 and store.stashed_bytes()[1] > 0


def test_covered_layers_skip_the_python_wrapper_of_function_apply(monkeypatch):
    from twobp.engine import deferred

    def wrapper_called(*args, **kwargs):
        raise AssertionError("Function.apply's Python wrapper ran")

    monkeypatch.setattr(deferred.DeferredWeightFunction, "apply", wrapper_called)
    module = _mlp()
    store = defer_weight_grads(module)
    x, y = _forward(store, module, 0)
    assert type(y.grad_fn).__name__ == "DeferredWeightFunctionBackward"
    _input_pass(store, 0, x, y)
    store.backward_weight([0])
    store.finish_step()


def test_restore_stops_deferring():
    module = _mlp()
    store = defer_weight_grads(module)
    _, y = _forward(store, module, 1)
    assert type(y.grad_fn).__name__ == "DeferredWeightFunctionBackward"
    store.restore()
    _, y = _forward(store, module, 0)
    assert "DeferredWeightFunction" not in type(y.grad_fn).__name__
    defer_weight_grads(module)  # patchable again


def test_patching_twice_is_refused():
    module = _mlp()
    first = defer_weight_grads(module)  # held: a store that is gone frees its module
    with pytest.raises(TwoStageBackwardError, match="already deferred"):
        defer_weight_grads(module, label="stage 1")
    first.restore()


def test_a_parameter_of_another_module_in_a_covered_operation_is_refused():
    module = _mlp()
    store = defer_weight_grads(module, label="rank 1 stage 2")
    clone = copy.deepcopy(module)
    with (
        pytest.raises(TwoStageBackwardError, match=r"rank 1 stage 2: F.linear .* shape \[7, 5\]"),
        store.forward(0),
    ):
        clone(randn(4, 5, seed=0))
    # Frozen, the same parameters are constants: plain autograd.
    clone.requires_grad_(False)
    x = randn(4, 5, seed=0).requires_grad_()
    with store.forward(0):
        y = clone(x)
    assert "DeferredWeightFunction" not in type(y.grad_fn).__name__
    defer_weight_grads(clone)  # the copy is no module of the first store


def test_stashed_bytes_positive_after_input_and_zero_after_weight():
    module = _mlp()
    store = defer_weight_grads(module)
    runs = {mb: _forward(store, module, mb) for mb in range(3)}
    assert store.stashed_bytes() == {0: 0, 1: 0, 2: 0}
    for mb, (x, y) in runs.items():
        _input_pass(store, mb, x, y)
    stashed = store.stashed_bytes()
    # Linear 1 keeps X (4x5) and dY (4x7), Linear 2 keeps X (4x7) and dY (4x3); the
    # input of Linear 2 is tanh's output, stored once.
    assert stashed == {mb: 8 * (4 * 5 + 4 * 7 + 4 * 7 + 4 * 3) for mb in range(3)}
    assert store.pending_weight() == (0, 1, 2)
    store.backward_weight([2, 0])
    assert store.stashed_bytes() == {0: 0, 1: stashed[1], 2: 0}
    store.backward_weight([1])
    assert store.stashed_bytes() == {0: 0, 1: 0, 2: 0}
    store.finish_step()
    assert store.stashed_bytes() == {}


def test_misuse_raises_with_the_micro_batch_named():
    module = _mlp()
    store = defer_weight_grads(module, label="rank 0 stage 1")
    x, y = _forward(store, module, 0)
    with pytest.raises(TwoStageBackwardError, match="before its backward_input"):
        store.backward_weight([0])
    with pytest.raises(TwoStageBackwardError, match="no forward"):
        store.backward_weight([7])
    with pytest.raises(TwoStageBackwardError, match="already"):
        _forward(store, module, 0)
    _input_pass(store, 0, x, y)
    with pytest.raises(TwoStageBackwardError, match="twice"):
        _input_pass(store, 0, x, y)
    with pytest.raises(ValueError, match="weight_group_size"):
        store.backward_weight([0], weight_group_size=0)
    with pytest.raises(TwoStageBackwardError, match=r"rank 0 stage 1.*no backward_weight"):
        store.finish_step()
    # The failed finish cleared the step: ids are reusable.
    x, y = _forward(store, module, 0)
    store.backward_full(0, [y], [torch.ones_like(y)], [x])
    with pytest.raises(TwoStageBackwardError, match="twice"):
        store.backward_weight([0])
    store.finish_step()


def test_finish_step_with_a_forward_but_no_input_pass_raises():
    module = _mlp()
    store = defer_weight_grads(module)
    _forward(store, module, 2)
    with pytest.raises(TwoStageBackwardError, match=r"no backward_input: micro-batches \[2\]"):
        store.finish_step()


def test_backward_of_a_deferred_forward_outside_backward_input_raises():
    module = _mlp()
    store = defer_weight_grads(module)
    _, y = _forward(store, module, 0)
    with pytest.raises(TwoStageBackwardError, match="outside backward_input"):
        y.sum().backward()


def test_nested_forward_and_input_pass_inside_forward_raise():
    module = _mlp()
    store = defer_weight_grads(module)
    with store.forward(0), pytest.raises(TwoStageBackwardError, match="inside the forward"):
        _forward(store, module, 1)
    x, y = _forward(store, module, 2)
    with store.forward(3), pytest.raises(TwoStageBackwardError, match="is active"):
        _input_pass(store, 2, x, y)


def test_a_failed_forward_is_forgotten():
    module = _mlp()
    store = defer_weight_grads(module)
    with pytest.raises(RuntimeError), store.forward(0):
        module(randn(4, 6, seed=0))  # wrong width
    _forward(store, module, 0)  # not "already ran"


def test_in_place_change_of_a_stashed_tensor_is_caught_before_w():
    module = _mlp()
    store = defer_weight_grads(module)
    x = randn(4, 5, seed=0)  # the first layer stashes x itself
    with store.forward(0):
        y = module(x)
    store.backward_input(0, [y], [torch.ones_like(y)], [x])
    x.add_(1.0)
    with pytest.raises(TwoStageBackwardError, match="modified in place"):
        store.backward_weight([0])
    assert all(p.grad is None for p in module.parameters())


def test_input_gradients_none_zeros_and_previous_grad_kept():
    module = seeded(lambda: nn.Linear(5, 3))()
    store = defer_weight_grads(module)
    x = randn(4, 5, seed=0).requires_grad_()
    unused = randn(2, seed=1).requires_grad_()
    constant = randn(2, seed=2)
    x.grad = torch.full_like(x, 7.0)
    with store.forward(0):
        y = module(x)
    gx, gu, gc = store.backward_input(0, [y], [torch.ones_like(y)], [x, unused, constant])
    assert torch.allclose(gx, torch.ones(4, 3, dtype=torch.float64) @ module.weight.detach())
    assert torch.equal(gu, torch.zeros(2, dtype=torch.float64))
    assert gc is None
    assert torch.equal(x.grad, torch.full_like(x, 7.0))
    with pytest.raises(ValueError, match="not a leaf"):
        store.backward_input(1, [y], [None], [x * 2])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_inside_a_stage(use_reentrant):
    def make():
        return seeded(lambda: nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 4)))()

    module, reference = make(), make()
    store = defer_weight_grads(module)
    grads, ref_grads = [], []
    for mb in range(3):
        x = randn(3, 5, seed=mb).requires_grad_()
        with store.forward(mb):
            y = checkpoint(module, x, use_reentrant=use_reentrant)
        grads.append(store.backward_input(mb, [y], [torch.ones_like(y)], [x])[0])
        xr = randn(3, 5, seed=mb).requires_grad_()
        reference(xr).sum().backward()
        ref_grads.append(xr.grad)
    store.backward_weight(range(3))
    store.finish_step()
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() <= TOL
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= TOL


def test_report_lists_deferred_immediate_and_frozen_with_reasons():
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.emb = nn.Embedding(5, 4, sparse=True)
            self.gru = nn.GRUCell(4, 4)
            self.scale = nn.Parameter(torch.ones(4))
            self.frozen = nn.Linear(4, 4).requires_grad_(False)

    store = defer_weight_grads(Stage(), label="rank 2 stage 5")
    report = store.report()
    assert report.startswith("2BP weight gradients of rank 2 stage 5: 2 deferred, 6 immediate")
    assert [n for n, _ in store.deferred_parameters()] == ["lin.weight", "lin.bias"]
    immediate = dict(store.immediate_parameters())
    assert list(immediate) == [
        "scale",
        "emb.weight",
        "gru.weight_ih",
        "gru.weight_hh",
        "gru.bias_ih",
        "gru.bias_hh",
    ]
    assert "sparse=True" in report
    assert "GRUCell 'gru', a type without a deferred W" in report
    assert "frozen.weight" in report


def test_subclass_that_overrides_forward_is_not_covered():
    class Clipped(nn.Linear):
        def forward(self, x):
            return super().forward(x).clamp(-1, 1)

    store = defer_weight_grads(Clipped(3, 3))
    assert store.deferred_parameters() == []
    assert [n for n, _ in store.immediate_parameters()] == ["weight", "bias"]


class _KeepsTransposedWeight(nn.Module):
    """Reads its weight through a view, keeps the view, and notes the classes it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.seen: list[tuple[type, type]] = []
        self.kept: torch.Tensor | None = None
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight.t()
        self.seen.append((type(self.lin.weight), type(w)))
        self.kept = w
        if self.fail:
            raise RuntimeError("the forward failed")
        return x @ w + self.lin.bias


def test_later_forwards_route_by_the_parameters_class_and_restore_it():
    module = seeded(_KeepsTransposedWeight)()
    store = defer_weight_grads(module)
    for mb in range(3):
        _, y = _forward(store, module, mb)
        assert type(y.grad_fn).__name__ == "AddBackward0"  # the bias is read elementwise
        assert type(y.grad_fn.next_functions[0][0]).__name__ == "DeferredWeightFunctionBackward"
        assert type(module.lin.weight) is nn.Parameter
        assert type(module.kept) is torch.Tensor
    # The first forward ran under the mode; later ones saw the classes that route the calls.
    assert module.seen[0] == (nn.Parameter, torch.Tensor)
    for weight_class, view_class in module.seen[1:]:
        assert weight_class is not nn.Parameter and issubclass(weight_class, nn.Parameter)
        assert view_class is not torch.Tensor and issubclass(view_class, torch.Tensor)
    module.fail = True
    with pytest.raises(RuntimeError, match="failed"):
        _forward(store, module, 3)
    assert type(module.lin.weight) is nn.Parameter and type(module.lin.bias) is nn.Parameter
    assert type(module.kept) is torch.Tensor
    # Another store's forward inside this one is refused on this path too.
    module.fail = False
    other = _mlp()
    other_store = defer_weight_grads(other)
    with store.forward(4), pytest.raises(TwoStageBackwardError, match="another stage"):  # noqa: SIM117
        with other_store.forward(0):
            pass


def test_parameters_of_another_class_keep_it_and_are_captured_by_the_mode():
    class Tagged(nn.Parameter):
        pass

    module = _mlp()
    module[0].weight = Tagged(module[0].weight.detach().clone())
    reference = copy.deepcopy(module)
    store = defer_weight_grads(module)
    for mb in range(3):
        x, y = _forward(store, module, mb)
        assert type(module[0].weight) is Tagged
        _input_pass(store, mb, x, y)
        xr = randn(4, 5, seed=mb)
        reference(xr).sum().backward()
    store.backward_weight(range(3))
    store.finish_step()
    deferred = [n for n, _ in store.deferred_parameters()]
    assert deferred == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max() <= TOL


def test_the_former_name_of_the_cap_still_works_and_says_the_new_one():
    module = _mlp()
    store = defer_weight_grads(module)
    for mb in range(2):
        _input_pass(store, mb, *_forward(store, module, mb))
    with pytest.warns(DeprecationWarning, match="weight_group_size"):
        store.backward_weight([0, 1], group_size=1)
    assert store.pending_weight() == ()
    store.finish_step()
