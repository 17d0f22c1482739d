"""Which submodules get a deferred weight gradient, and where every parameter's gradient comes from.

A parameter is *deferred* when a covered layer owns it: its gradient is added
by the weight pass (W). It is *immediate* when no covered layer owns it (a raw
``nn.Parameter``, a custom module, a layer type or configuration the engine
does not cover): autograd accumulates its exact gradient during the input
pass (I). A parameter that a covered layer owns and other code also uses (a
tied embedding read through ``F.linear``) gets both parts, and the sum is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from torch import nn
from torch.nn.utils import parametrize

from twobp.engine.deferred import DeferredLayer
from twobp.engine.layers import deferred_layer_for


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
        name: the parameter's qualified name in the patched model.
        parameter: the parameter itself.
        route: when its gradient is computed.
        reason: a short human explanation.
    """

    name: str
    parameter: nn.Parameter
    route: Route
    reason: str


@dataclass(frozen=True)
class CoveredModule:
    """A submodule that gets a deferred weight gradient.

    Args:
        name: its qualified name (``""`` for the root).
        module: the submodule.
        layer_class: the class that runs it.
    """

    name: str
    module: nn.Module
    layer_class: type[DeferredLayer]


@dataclass(frozen=True)
class CoveragePlan:
    """The covered submodules of a model and the route of each parameter."""

    covered: tuple[CoveredModule, ...]
    routes: tuple[ParameterRoute, ...]

    def parameters(self, route: Route) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter on ``route``, in model order."""
        return [(r.name, r.parameter) for r in self.routes if r.route is route]

    def report(self, label: str = "") -> str:
        """A table of every parameter: deferred, immediate or frozen, and why."""
        counts = ", ".join(f"{len(self.parameters(route))} {route.value}" for route in Route)
        lines = [f"2BP weight gradients{' of ' + label if label else ''}: {counts}"]
        width = max((len(r.name) for r in self.routes), default=0)
        headings = {
            Route.DEFERRED: "deferred (added by backward_weight, concatenated over micro-batches):",
            Route.IMMEDIATE: "immediate (accumulated by autograd during backward_input):",
            Route.FROZEN: "frozen (requires_grad=False):",
        }
        for route, heading in headings.items():
            rows = [r for r in self.routes if r.route is route]
            if rows:
                lines.append(heading)
                lines.extend(f"  {r.name:<{width}}  {r.reason}" for r in rows)
        return "\n".join(lines)


def _describe(name: str, module: nn.Module) -> str:
    return f"{type(module).__name__} '{name}'" if name else f"{type(module).__name__} (root)"


def _unsupported_reason(module: nn.Module, layer_class: type[DeferredLayer]) -> str | None:
    params = list(module.parameters(recurse=False))
    if not params:
        return "has no parameters"
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in params):
        return "lazy parameters are not initialised yet (run one forward first)"
    if parametrize.is_parametrized(module):
        return "its weight is computed by a parametrization"
    reason = layer_class.unsupported_reason(module)
    if reason is not None:
        return reason
    if not any(p.requires_grad for p in params):
        return "no parameter requires a gradient"
    return None


def plan_coverage(model: nn.Module) -> CoveragePlan:
    """Decide which submodules of ``model`` to cover and route every parameter.

    Args:
        model: the stage module.

    Returns:
        The covered submodules (each once, even if registered twice) and the
        route of every parameter of ``model``.
    """
    covered: dict[int, CoveredModule] = {}
    left_out: dict[int, str] = {}
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, module))
        layer_class = deferred_layer_for(module)
        if layer_class is None:
            continue
        reason = _unsupported_reason(module, layer_class)
        if reason is None:
            covered[id(module)] = CoveredModule(name, module, layer_class)
        else:
            left_out[id(module)] = f"{_describe(name, module)} not covered: {reason}"

    routes = []
    for pname, p in model.named_parameters():
        owned_by = owners.get(id(p), [])
        by_covered = [_describe(n, m) for n, m in owned_by if id(m) in covered]
        by_others = [_describe(n, m) for n, m in owned_by if id(m) not in covered]
        if not p.requires_grad:
            routes.append(ParameterRoute(pname, p, Route.FROZEN, "requires_grad=False"))
        elif by_covered:
            reason = f"in {', '.join(by_covered)}"
            if by_others:
                reason += f"; also owned by {', '.join(by_others)}, whose use is immediate"
            routes.append(ParameterRoute(pname, p, Route.DEFERRED, reason))
        else:
            m_name, m = owned_by[0]
            reason = left_out.get(
                id(m), f"owned by {_describe(m_name, m)}, a type without a deferred W"
            )
            routes.append(ParameterRoute(pname, p, Route.IMMEDIATE, reason))
    return CoveragePlan(tuple(covered.values()), tuple(routes))
