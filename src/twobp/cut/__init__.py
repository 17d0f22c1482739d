"""Cut an ordinary ``nn.Module`` into the blocks of a :class:`twobp.Pipeline` (``twobp.split``).

``twobp.split(model)`` handles the common shape without configuration: a
forward that runs some modules (embeddings), then the layers of one
``nn.ModuleList`` or ``nn.Sequential`` in order, then some more (a norm and
a head); it cuts before every layer and after the last one. ``at=[...]`` names
the cut points instead, by qualified module name (``at=["layers.4",
"layers.8"]``: three blocks, the second starting at ``layers.4``), anywhere in
the module tree.

The forward is traced with ``torch.fx`` (an existing engine, as
``torch.distributed.pipelining`` uses ``torch.export``), down to the modules a
cut needs to see; every other module runs whole, as written. Values the layers
need beside the hidden states (a causal mask, position ids, rotary tables)
are computed again in every block that needs them from the inputs and
buffers, as ``twobp.integrations.transformers`` does; the model's inputs
travel with the hidden states where a later block needs them.

The blocks share the model's modules and parameters, so a tied weight (an
output head that is the token embedding) stays one parameter, which the
pipeline keeps equal on every rank that holds it. The returned
:class:`ModelBlocks` remembers the model's own names: a pipeline built on it
names its ``state_dict()``, ``named_parameters()``, checkpoints and
``merge`` like ``model.state_dict()``, so that
``type(model)().load_state_dict(merged, strict=True)`` loads the trained weights.

Example::

    pipe = twobp.Pipeline(twobp.split(GPT()), loss, schedule="1f1b", n_microbatches=4)
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from twobp.cut.blocks import body, cut, drop_empty, kinds, model_names
from twobp.cut.errors import SplitError
from twobp.cut.trace import trace


class ModelBlocks(nn.Sequential):
    """The blocks of a model cut by :func:`split`, with the model's names of their entries."""

    model_names: dict[str, tuple[str, ...]]
    """For every entry of this ``state_dict()`` (``"3.layers.2.attn.weight"``), its names in
    the model's ``state_dict()`` (every name of a tied weight; none for an entry the model
    does not save)."""
    model_type: str
    """The class name of the cut model."""

    def __init__(self, blocks: Sequence[nn.Module], model: nn.Module) -> None:
        super().__init__(*blocks)
        self.model_names = model_names(model, blocks)
        self.model_type = type(model).__name__


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def layers_of(model: nn.Module) -> str:
    """The qualified name of the ``ModuleList`` or ``Sequential`` that holds ``model``'s layers:
    the one of at least two modules with the most parameters ("" for a Sequential model).

    Raises:
        SplitError: if the model has none.
    """
    if isinstance(model, nn.Sequential):
        return ""
    candidates = [
        (sum(p.numel() for p in m.parameters()), -name.count("."), name)
        for name, m in model.named_modules()
        if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
    ]
    if not candidates:
        raise SplitError(
            f"twobp.split found no nn.ModuleList or nn.Sequential of layers in "
            f"{type(model).__name__}; name the cut points with at=[...] (qualified module "
            "names, e.g. at=['encoder.block3'])"
        )
    name: str = max(candidates)[2]
    return name


def _first_use(nodes: Sequence[object], name: str) -> list[int]:
    """The indices of the nodes that call module ``name`` (or one inside it) or read its
    attributes, each call of it once."""
    found = []
    for i, node in enumerate(nodes):
        op, target = getattr(node, "op", ""), str(getattr(node, "target", ""))
        if op in ("call_module", "get_attr") and (target == name or target.startswith(name + ".")):
            found.append(i)
    return found


def _check_cut_points(model: nn.Module, at: Sequence[str]) -> None:
    modules = dict(model.named_modules())
    for name in at:
        if not isinstance(name, str) or not name or name not in modules:
            near = [n for n in modules if n and n.rsplit(".", 1)[0] == str(name).rsplit(".", 1)[0]]
            hint = f" (modules there: {', '.join(near[:8])})" if near else ""
            raise SplitError(
                f"twobp.split: at= names {name!r}, which is not a module of "
                f"{type(model).__name__}{hint}; give qualified names as in named_modules()"
            )
    if len(set(at)) != len(at):
        raise SplitError(f"twobp.split: at= names a module twice: {list(at)}")


def split(model: nn.Module, at: Sequence[str] | None = None) -> ModelBlocks:
    """Cut ``model`` into pipeline blocks.

    Args:
        model: the whole model, an ``nn.Module`` whose ``forward`` takes the
            batch (one tensor, or several: the first block then takes their
            tuple) and returns what the loss takes. Keyword parameters with a
            default keep it (``targets=None``).
        at: qualified names of the modules that start a new block (in the order the
            forward runs them). None: before every layer of the model's
            ``ModuleList``/``Sequential`` of layers, and after the last one.

    Returns:
        The blocks in order, sharing the model's modules and parameters; the
        first takes the forward's inputs, the last returns its output.

    Raises:
        SplitError: naming the module, if the model cannot be cut there: its
            forward cannot be traced (control flow on tensor values), a cut
            module is not called or is called more than once, the layers run
            out of order, or no layers were found.
    """
    if not isinstance(model, nn.Module):
        raise SplitError(f"twobp.split takes an nn.Module, got {type(model).__name__}")
    name = type(model).__name__
    if at is None:
        container = layers_of(model)
        prefix = f"{container}." if container else ""
        points = [prefix + child for child, _ in model.get_submodule(container).named_children()]
        inside = {container, *_ancestors(container)} if container else set()
    else:
        _check_cut_points(model, list(at))
        points = list(at)
        inside = {a for point in points for a in _ancestors(point)}
    graph = trace(model, inside)
    nodes = body(graph)
    starts = []
    for point in points:
        uses = _first_use(nodes, point)
        calls = [i for i in uses if nodes[i].op == "call_module" and nodes[i].target == point]
        if not uses:
            raise SplitError(f"twobp.split cannot cut {name} at {point}: its forward never runs it")
        if len(calls) > 1:
            raise SplitError(
                f"twobp.split cannot cut {name} at {point}: its forward runs it "
                f"{len(calls)} times; cut at a module that runs once"
            )
        starts.append(uses[0])
    for before, after, a, b in zip(starts, starts[1:], points, points[1:], strict=False):
        if after <= before:
            raise SplitError(
                f"twobp.split cannot cut {name}: its forward runs {b} before {a} (or inside "
                f"it), so the blocks would not follow each other; list the cut points in the "
                "order the forward runs them (at=[...])"
            )
    node_kinds = kinds(model, graph)
    boundaries = list(starts)
    if at is None:
        # The layers' own blocks end where the last one's calls do; the rest is one more block.
        last = points[-1]
        end = max(i for i in range(len(nodes)) if i in set(_first_use(nodes, last))) + 1
        heavy_after = [
            i
            for i in range(end, len(nodes))
            if nodes[i].op in ("call_module", "get_attr") and nodes[i] in node_kinds.heavy
        ]
        if heavy_after:
            boundaries.append(heavy_after[0])
    boundaries = drop_empty([b for b in boundaries if b > 0], nodes, node_kinds)
    return ModelBlocks(cut(model, graph, boundaries, node_kinds), model)


__all__ = ["ModelBlocks", "SplitError", "layers_of", "split"]
