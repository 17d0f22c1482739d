"""Run micro-batches through a patched module and through plain autograd, and compare.

A *schedule* here is a list of steps of one stage: ``("F", mb)``,
``("I", mb)``, ``("B", mb)`` or ``("W", mbs[, weight_group_size])`` with ``mbs`` in
any order. The reference runs every micro-batch with plain ``.backward()`` on a
deep copy of the module made before patching, accumulating gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from twobp.engine import WeightGradStore, defer_weight_grads

TOL = 1e-10

Step = tuple[Any, ...]
# mb -> tuple of (tensor, requires_grad)
InputMaker = Callable[[int], Sequence[tuple[Tensor, bool]]]


def plan_f_i_w(n: int, weight_steps: Sequence[Step]) -> list[Step]:
    """All forwards, then all input passes in reverse order, then ``weight_steps``."""
    return (
        [("F", m) for m in range(n)] + [("I", m) for m in reversed(range(n))] + list(weight_steps)
    )


def weight_plans(n: int) -> dict[str, list[Step]]:
    """The W plans every test runs: per micro-batch, all at once, mixed groupings."""
    mbs = list(range(n))
    mixed: list[Step] = [("W", tuple(reversed(mbs[1:])), 2), ("W", (0,))]
    return {
        "per-microbatch": [("W", (m,)) for m in mbs],
        "concatenated": [("W", tuple(mbs))],
        "mixed": mixed,
    }


def interleaved(n: int) -> list[Step]:
    """A 1F1B-like order with I and W interleaved with forwards (n >= 3)."""
    steps: list[Step] = [("F", 0), ("F", 1), ("I", 0), ("F", 2), ("I", 1), ("W", (0,))]
    steps += [("F", m) for m in range(3, n)]
    steps += [("I", m) for m in range(2, n)]
    steps.append(("W", tuple(range(n - 1, 0, -1))))
    return steps


def _outputs(result: Any) -> tuple[Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _grad_output(out: Tensor, mb: int, k: int) -> Tensor | None:
    if not out.requires_grad:
        return None
    g = torch.Generator().manual_seed(1000 * mb + k)
    return torch.randn(out.shape, generator=g, dtype=out.dtype)


def _leaves(make_inputs: InputMaker, mb: int) -> list[Tensor]:
    return [x.detach().clone().requires_grad_(rg) for x, rg in make_inputs(mb)]


@dataclass
class Comparison:
    """Largest differences between the patched run and the reference."""

    input_grads: float = 0.0
    param_grads: dict[str, float] = field(default_factory=dict)
    buffers: float = 0.0
    outputs: float = 0.0

    def worst(self) -> float:
        return max([self.input_grads, self.buffers, self.outputs, *self.param_grads.values()])


def _diff(a: Tensor | None, b: Tensor | None) -> float:
    if a is None or b is None:
        assert a is None and b is None, "one side has a gradient, the other none"
        return 0.0
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def compare_with_autograd(
    module: nn.Module,
    make_inputs: InputMaker,
    schedule: Sequence[Step],
    steps: int = 1,
) -> tuple[Comparison, WeightGradStore]:
    """Run ``schedule`` (``steps`` times) on a patched ``module`` and on plain autograd.

    ``module`` is patched in place; the reference is a deep copy made first.
    """
    reference = copy.deepcopy(module)
    store = defer_weight_grads(module)
    result = Comparison()
    mbs = sorted({s[1] for s in schedule if s[0] in "FB"})
    for _ in range(steps):
        ref_grads, ref_outs = {}, {}
        for mb in mbs:
            leaves = _leaves(make_inputs, mb)
            outs = _outputs(reference(*leaves))
            pairs = [(o, _grad_output(o, mb, k)) for k, o in enumerate(outs) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            ref_grads[mb] = [x.grad if x.requires_grad else None for x in leaves]
            ref_outs[mb] = outs

        inputs: dict[int, list[Tensor]] = {}
        outputs: dict[int, tuple[Tensor, ...]] = {}
        got: dict[int, tuple[Tensor | None, ...]] = {}
        for step in schedule:
            kind, mb = step[0], step[1]
            if kind == "F":
                inputs[mb] = _leaves(make_inputs, mb)
                with store.forward(mb):
                    outputs[mb] = _outputs(module(*inputs[mb]))
            elif kind in "IB":
                if mb not in outputs:  # B of a forward run as plain autograd
                    inputs[mb] = _leaves(make_inputs, mb)
                    outputs[mb] = _outputs(module(*inputs[mb]))
                outs = outputs[mb]
                grads = [_grad_output(o, mb, k) for k, o in enumerate(outs)]
                run = store.backward_input if kind == "I" else store.backward_full
                got[mb] = run(mb, list(outs), grads, inputs[mb])
            elif kind == "W":
                store.backward_weight(list(mb), *step[2:])
            else:
                raise ValueError(step)
        store.finish_step()

        for mb in mbs:
            for a, b in zip(got[mb], ref_grads[mb], strict=True):
                result.input_grads = max(result.input_grads, _diff(a, b))
            for a, b in zip(outputs[mb], ref_outs[mb], strict=True):
                result.outputs = max(result.outputs, _diff(a.detach(), b.detach()))
    for (name, p), (_, q) in zip(
        module.named_parameters(), reference.named_parameters(), strict=True
    ):
        result.param_grads[name] = _diff(p.grad, q.grad)
    for a, b in zip(module.buffers(), reference.buffers(), strict=True):
        result.buffers = max(result.buffers, _diff(a.double(), b.double()))
    return result, store


def assert_matches(
    make_module: Callable[[], nn.Module],
    make_inputs: InputMaker,
    n: int = 4,
    steps: int = 1,
) -> WeightGradStore:
    """Every W plan and an interleaved order give autograd's gradients (float64, 1e-10).

    Returns the store of the last run, for further checks.
    """
    schedules = {name: plan_f_i_w(n, w) for name, w in weight_plans(n).items()}
    schedules["interleaved"] = interleaved(n)
    store = None
    for name, schedule in schedules.items():
        comparison, store = compare_with_autograd(make_module(), make_inputs, schedule, steps)
        assert comparison.worst() <= TOL, (name, comparison)
        assert comparison.param_grads, "the module has no parameters to compare"
    assert store is not None
    return store


def seeded(factory: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    """A factory that builds the same float64 module every call (random affine norms too)."""

    def make() -> nn.Module:
        torch.manual_seed(seed)
        module = factory().double()
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("weight") and p.dim() == 1:
                    p.uniform_(0.5, 1.5)  # norms start at ones: make them generic
                elif name.endswith("bias") and p.dim() == 1:
                    p.uniform_(-0.5, 0.5)
        return module

    return make


def randn(*shape: int, seed: int) -> Tensor:
    """A float64 normal tensor from its own generator."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
