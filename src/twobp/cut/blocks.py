"""Cutting a traced forward into blocks that pass their live values on.

The nodes of the graph fall into three kinds:

- the *inputs* (the forward's placeholders);
- *heavy* nodes: a call of a module that has parameters, a read of a
  parameter, and everything computed from those. They run in exactly one
  block: the one whose range of the graph holds them;
- *side* nodes: computed from the inputs, buffers and constants alone (a
  causal mask, position ids, rotary tables, a sequence length). They are
  computed again in every block that needs them, as
  ``twobp.integrations.transformers`` does, so that only tensors that carry
  gradients (and the inputs the side nodes need) travel between ranks.

A block takes the values that are live at its start (one tensor, or a tuple)
and returns those live at its end; the last one returns what the forward
returns.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn


@dataclass(frozen=True)
class Kinds:
    """Which nodes of a graph are inputs, heavy or side (see the module docstring)."""

    inputs: tuple[fx.Node, ...]
    heavy: frozenset[fx.Node]

    def is_side(self, node: fx.Node) -> bool:
        return node.op != "output" and node not in self.heavy and node not in self.inputs


def _reads_parameters(model: nn.Module, node: fx.Node) -> bool:
    if node.op == "call_module":
        return any(True for _ in model.get_submodule(str(node.target)).parameters())
    if node.op == "get_attr":
        value = _attribute(model, str(node.target))
        if isinstance(value, nn.Module):
            return any(True for _ in value.parameters())
        return isinstance(value, nn.Parameter)
    return False


def _attribute(model: nn.Module, target: str) -> object:
    value: object = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def kinds(model: nn.Module, graph: fx.Graph) -> Kinds:
    """Sort the nodes of ``graph`` (traced from ``model``) into inputs, heavy and side."""
    heavy: set[fx.Node] = set()
    inputs: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            inputs.append(node)
        elif node.op != "output" and (
            _reads_parameters(model, node) or any(a in heavy for a in node.all_input_nodes)
        ):
            heavy.add(node)
    return Kinds(tuple(inputs), frozenset(heavy))


def body(graph: fx.Graph) -> list[fx.Node]:
    """The nodes before the output, in order (the placeholders too)."""
    return [n for n in graph.nodes if n.op != "output"]


def drop_empty(boundaries: Sequence[int], nodes: Sequence[fx.Node], node_kinds: Kinds) -> list[int]:
    """The boundaries (indices into ``nodes`` where a block starts) less those that would
    leave a block without heavy nodes: such a block joins its neighbour."""
    kept = list(boundaries)
    changed = True
    while changed:
        changed = False
        edges = [0, *kept, len(nodes)]
        for b in range(len(edges) - 1):
            if not any(n in node_kinds.heavy for n in nodes[edges[b] : edges[b + 1]]):
                # The first block joins the next; any other joins the one before.
                del kept[0 if b == 0 else b - 1]
                changed = True
                break
    return kept


@dataclass
class _Cut:
    """A graph cut before each of ``boundaries`` (indices into its :func:`body`)."""

    model: nn.Module
    graph: fx.Graph
    boundaries: Sequence[int]
    kinds: Kinds

    def __post_init__(self) -> None:
        self.nodes = body(self.graph)
        self.position = {n: i for i, n in enumerate(self.nodes)}
        self.n_blocks = len(self.boundaries) + 1
        self.output = next(n for n in self.graph.nodes if n.op == "output")
        # The blocks where every heavy node and input is needed, and where every side node runs.
        self.needed: dict[fx.Node, set[int]] = {}
        for node in self.nodes:
            if node in self.kinds.heavy:
                for source in node.all_input_nodes:
                    self._need(source, self.block_of(node))
        for source in self.output.all_input_nodes:
            self._need(source, self.n_blocks - 1)

    def _need(self, node: fx.Node, where: int) -> None:
        if where in self.needed.setdefault(node, set()):
            return
        self.needed[node].add(where)
        if self.kinds.is_side(node):
            for source in node.all_input_nodes:
                self._need(source, where)

    def block_of(self, node: fx.Node) -> int:
        """The block a node belongs to by its place in the graph (-1: an input)."""
        if node in self.kinds.inputs:
            return -1
        return bisect_right(self.boundaries, self.position[node])

    def runs_in(self, node: fx.Node, b: int) -> bool:
        """True if block ``b`` computes ``node`` (a side node, maybe again)."""
        if node in self.kinds.inputs:
            return False
        if node in self.kinds.heavy:
            return self.block_of(node) == b
        return b in self.needed.get(node, ())

    def live_at(self, start: int) -> list[fx.Node]:
        """The values that block ``start`` receives from the block before it."""
        if start == 0:
            return list(self.kinds.inputs)
        return [
            n
            for n in self.nodes
            if (n in self.kinds.inputs or n in self.kinds.heavy)
            and self.block_of(n) < start
            and max(self.needed.get(n, {-1})) >= start
        ]

    def block(self, b: int) -> fx.GraphModule:
        """Block ``b``: its live values in, its nodes (side nodes again), its live values out."""
        new = fx.Graph()
        env: dict[fx.Node, Any] = {}
        received = self.live_at(b)
        given = new.placeholder("inputs")
        if len(received) == 1:
            env[received[0]] = given
        else:
            for i, value in enumerate(received):
                env[value] = new.call_function(operator.getitem, (given, i))
        for node in self.nodes:
            if self.runs_in(node, b):
                env[node] = new.node_copy(node, env.__getitem__)
        if b == self.n_blocks - 1:
            new.output(fx.map_arg(self.output.args[0], env.__getitem__))
        else:
            passed = [env[v] for v in self.live_at(b + 1)]
            new.output(passed[0] if len(passed) == 1 else tuple(passed))
        block = fx.GraphModule(self.model, new, class_name=f"{type(self.model).__name__}Block")
        block.train(self.model.training)
        return block


def cut(
    model: nn.Module, graph: fx.Graph, boundaries: Sequence[int], node_kinds: Kinds
) -> list[fx.GraphModule]:
    """The blocks of ``graph``, cut before each index of ``boundaries`` into :func:`body`.

    Args:
        model: the traced model; the blocks share its modules and parameters.
        graph: its traced forward.
        boundaries: increasing indices into ``body(graph)``, none 0.
        node_kinds: :func:`kinds` of the graph.
    """
    plan = _Cut(model, graph, boundaries, node_kinds)
    return [plan.block(b) for b in range(plan.n_blocks)]


def model_names(model: nn.Module, blocks: Sequence[nn.Module]) -> dict[str, tuple[str, ...]]:
    """For every entry of ``nn.Sequential(*blocks).state_dict()``, its ``model.state_dict()`` names.

    Tensors are matched by identity: a tied weight has every name the model
    gives it, and an entry the model does not save (a non-persistent buffer)
    has none.
    """
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {
        f"{i}.{name}": tuple(by_tensor.get(id(tensor), ()))
        for i, block in enumerate(blocks)
        for name, tensor in block.state_dict(keep_vars=True).items()
        if isinstance(tensor, torch.Tensor)
    }
