"""Tracing a model's forward with torch.fx, down to the modules a cut needs to see.

Every submodule is a leaf (called as a whole, its forward not traced) except
the model itself, the module that holds the layers, and every module that
holds a cut point further down. Parameters of the forward's keywords that
have a default (``targets=None``) are fixed at it, so that the usual
``if targets is not None`` does not stop the trace.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import torch.fx as fx
from torch import nn

from twobp.cut.errors import SplitError


class _Tracer(fx.Tracer):
    """A tracer that traces into ``inside`` only and remembers where it is."""

    def __init__(self, inside: Collection[str]) -> None:
        super().__init__()
        self.inside = set(inside)
        self.where: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.inside

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        self.where.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.where.pop()


def _defaults(model: nn.Module) -> dict[str, Any]:
    """The forward's parameters that have a default, at that default."""
    signature = inspect.signature(model.forward)
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _put(arg: Any, node: fx.Node, value: Any) -> Any:
    """``arg`` with ``value`` in the place of ``node`` (in a list or tuple too)."""
    if arg is node:
        return value
    if isinstance(arg, (list, tuple)):
        return type(arg)(_put(a, node, value) for a in arg)
    return arg


def _inline_fixed(graph: fx.Graph, n_fixed: int) -> None:
    """Put the defaults of the last ``n_fixed`` placeholders in their place, without the
    checks torch.fx adds that they keep that value."""
    if not n_fixed:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders[-n_fixed:]:
        value = node.args[0] if node.args else None
        for user in list(node.users):
            if user.op == "call_function" and not user.users and "assert" in str(user.target):
                graph.erase_node(user)
                continue
            user.args = tuple(_put(a, node, value) for a in user.args)
            user.kwargs = {k: _put(a, node, value) for k, a in user.kwargs.items()}
        graph.erase_node(node)
    graph.lint()


def trace(model: nn.Module, inside: Collection[str]) -> fx.Graph:
    """The graph of ``model.forward``, with every module outside ``inside`` as a leaf.

    Args:
        model: the whole model.
        inside: qualified names of the submodules whose forward is traced
            through ("" is the model itself and is always traced).

    Raises:
        SplitError: naming the module whose forward cannot be traced (data-dependent
            control flow, a call torch.fx cannot follow) and what torch.fx said.
    """
    tracer = _Tracer({"", *inside})
    fixed = _defaults(model)
    try:
        graph = tracer.trace(model, concrete_args=fixed or None)
    except Exception as error:  # torch.fx raises TraceError, TypeError, RuntimeError...
        where = tracer.where[-1] if tracer.where else ""
        name = type(model.get_submodule(where) if where else model).__name__
        label = f"{where} ({name})" if where else name
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if type(model).__module__.startswith("transformers."):
            raise SplitError(
                f"twobp.split cannot cut {type(model).__name__}, a Hugging Face transformers "
                f"model: torch.fx cannot trace its forward ({type(error).__name__}: {detail}); "
                "use twobp.integrations.transformers.blocks(model) and loss_function(model), "
                "which cut the families they know by their layers"
            ) from error
        raise SplitError(
            f"twobp.split cannot cut {type(model).__name__}: the forward of {label} cannot be "
            f"traced by torch.fx ({type(error).__name__}: {detail}). Usually that is control "
            "flow on a tensor's values; cut elsewhere with at=[...] so that this module runs "
            "whole inside one block, or pass a list of blocks to Pipeline yourself"
        ) from error
    _inline_fixed(graph, len(fixed))
    return graph
