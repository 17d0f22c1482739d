"""Where every parameter's gradient comes from, and why: the store's report.

A parameter is *deferred* when the forwards read it as the weight operand of
covered operations only: its gradient is added by the weight pass (W). It is
*immediate* when some other operation reads it (a gate multiplied
elementwise, an operation the engine does not split, a custom autograd
Function): autograd accumulates its exact gradient during the input pass (I).
A parameter read both ways gets both parts, and the sum is exact; it counts as
deferred, since its gradient is complete only after W.

Before any forward the routes are predicted from the type of the module that
owns each parameter; the first forward replaces the prediction with what the
operations actually read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from torch import nn
from torch.nn.utils import parametrize

from twobp.engine.capture import Usage


class Route(Enum):
    """When a parameter's gradient is computed."""

    DEFERRED = "deferred"
    """By the weight pass (W), concatenated over micro-batches."""
    IMMEDIATE = "immediate"
    """By autograd during the input pass (I)."""
    FROZEN = "frozen"
    """Never: the parameter does not require a gradient."""


@dataclass(frozen=True)
class ParameterRoute:
    """Where one parameter's gradient comes from, and why.

    Args:
        name: the parameter's qualified name in the store's module.
        parameter: the parameter itself.
        route: when its gradient is computed.
        reason: a short human explanation.
        partly_immediate: a deferred parameter that an operation left to
            autograd reads too (autograd adds that part during I).
        expert_products: for a stacked expert weight ``[E, out, in]``, the
            per-expert products W concatenates over the micro-batches (0 otherwise).
    """

    name: str
    parameter: nn.Parameter
    route: Route
    reason: str
    partly_immediate: bool = False
    expert_products: int = 0


_PREDICTED: dict[type[nn.Module], str] = {
    nn.Linear: "F.linear",
    nn.Conv1d: "F.conv1d",
    nn.Conv2d: "F.conv2d",
    nn.Conv3d: "F.conv3d",
    nn.Embedding: "F.embedding",
    nn.LayerNorm: "F.layer_norm",
    nn.RMSNorm: "F.rms_norm",
    nn.GroupNorm: "F.group_norm",
    nn.BatchNorm1d: "F.batch_norm",
    nn.BatchNorm2d: "F.batch_norm",
    nn.BatchNorm3d: "F.batch_norm",
    nn.RNN: "torch.rnn_tanh",
    nn.GRU: "torch.gru",
    nn.LSTM: "torch.lstm",
}
"""Module types whose ``forward`` calls a covered operation with their parameters."""


def _describe(name: str, module: nn.Module) -> str:
    return f"{type(module).__name__} '{name}'" if name else f"{type(module).__name__} (root)"


def _predicted_op(module: nn.Module) -> tuple[str | None, str | None]:
    """The covered operation the module's forward calls, or why it is not expected to."""
    op = None
    for layer_type, name in _PREDICTED.items():
        if isinstance(module, layer_type) and type(module).forward is layer_type.forward:
            op = name
            break
    if op is None:
        return None, "a type without a deferred W"
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(False)):
        return None, "lazy parameters are not initialised yet (run one forward first)"
    if parametrize.is_parametrized(module):
        return None, "its weight is computed by a parametrization"
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None:
            return None, "max_norm renormalises the weight in place during forward"
        if module.scale_grad_by_freq:
            return None, "scale_grad_by_freq scales by per-batch index counts"
        if module.sparse:
            return None, "sparse=True produces sparse gradients"
    return op, None


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """The first module (in ``named_modules`` order) that registers each parameter."""
    owners: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), (name, module))
    return owners


def predicted_routes(model: nn.Module) -> tuple[ParameterRoute, ...]:
    """Each parameter's route as the type of the module that owns it suggests (no forward yet).

    Args:
        model: the store's module.
    """
    predicted: dict[int, tuple[Route, str]] = {}
    for name, module in model.named_modules():
        op, why_not = _predicted_op(module)
        where = _describe(name, module)
        for p in module.parameters(recurse=False):
            if op is not None:
                predicted.setdefault(id(p), (Route.DEFERRED, f"in {where} ({op}; predicted)"))
            else:
                why = f"owned by {where}, {why_not} (predicted)"
                predicted.setdefault(id(p), (Route.IMMEDIATE, why))
    routes = []
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            routes.append(ParameterRoute(pname, p, Route.FROZEN, "requires_grad=False"))
        else:
            routes.append(ParameterRoute(pname, p, *predicted[id(p)]))
    return tuple(routes)


_EXPERTS = re.compile(r" per expert(?: x(\d+))?$")


def _expert_products(uses: Mapping[str, int]) -> int:
    """The per-expert products among deferred uses: each ``w[e]`` op (``F.linear per
    expert``) is one; a grouped op (``grouped_mm per expert x4``) is one per expert."""
    total = 0
    for use, n in uses.items():
        found = _EXPERTS.search(use)
        if found is not None:
            total += n * int(found.group(1) or 1)
    return total


def _counted(uses: Mapping[str, int]) -> str:
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in uses.items())


def observed_routes(model: nn.Module, usage: Mapping[int, Usage]) -> tuple[ParameterRoute, ...]:
    """Each parameter's route as the forwards seen so far read it.

    Args:
        model: the store's module.
        usage: how the forwards read each parameter, by id.
    """
    owners = _owners(model)
    routes = []
    for pname, p in model.named_parameters():
        where = _describe(*owners[id(p)])
        seen = usage.get(id(p), Usage())
        immediate = "; ".join(seen.immediate)
        if not p.requires_grad:
            routes.append(ParameterRoute(pname, p, Route.FROZEN, "requires_grad=False"))
        elif seen.deferred:
            reason = f"{_counted(seen.deferred)} in {where}"
            if immediate:
                reason += f"; also {immediate}: autograd adds that part during backward_input"
            experts = _expert_products(seen.deferred)
            routes.append(
                ParameterRoute(pname, p, Route.DEFERRED, reason, bool(immediate), experts)
            )
        elif immediate:
            routes.append(ParameterRoute(pname, p, Route.IMMEDIATE, f"{immediate}, in {where}"))
        else:
            reason = (
                f"read by no operation of the forwards seen, in {where} (unused, or read inside "
                f"a custom autograd Function: autograd adds any gradient during backward_input)"
            )
            routes.append(ParameterRoute(pname, p, Route.IMMEDIATE, reason))
    return tuple(routes)


def format_report(routes: tuple[ParameterRoute, ...], label: str, observed: bool) -> str:
    """A table of every parameter: deferred, immediate or frozen, and why.

    Args:
        routes: every parameter's route.
        label: names the stage.
        observed: whether the routes come from forwards (else a prediction).
    """
    counts = ", ".join(f"{sum(r.route is route for r in routes)} {route.value}" for route in Route)
    lines = [f"2BP weight gradients{' of ' + label if label else ''}: {counts}"]
    lines.append(
        "(as the forwards seen so far read each parameter)"
        if observed
        else "(predicted from the module types; a forward shows how each parameter is read)"
    )
    width = max((len(r.name) for r in routes), default=0)
    headings = {
        Route.DEFERRED: "deferred (added by backward_weight, concatenated over micro-batches):",
        Route.IMMEDIATE: "immediate (accumulated by autograd during backward_input):",
        Route.FROZEN: "frozen (requires_grad=False):",
    }
    for route, heading in headings.items():
        rows = [r for r in routes if r.route is route]
        if rows:
            lines.append(heading)
            lines.extend(f"  {r.name:<{width}}  {r.reason}" for r in rows)
    return "\n".join(lines)


def deferred_share(routes: tuple[ParameterRoute, ...]) -> float:
    """The share of trainable parameter elements whose gradient W adds in full.

    A parameter also read by an operation left to autograd does not count.
    """
    trainable = [r for r in routes if r.route is not Route.FROZEN]
    total = sum(r.parameter.numel() for r in trainable)
    full = sum(
        r.parameter.numel()
        for r in trainable
        if r.route is Route.DEFERRED and not r.partly_immediate
    )
    return full / total if total else 0.0
