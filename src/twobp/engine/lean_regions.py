"""A region of a cut graph compiled by inductor, its two compiled graphs called directly.

Inductor compiles a graph through AOTAutograd: one forward graph, which returns the outputs
and what the backward keeps, and one backward graph, which takes those and the output
gradients. AOTAutograd calls them through its runtime wrappers, which handle what a whole
user graph may do (inputs changed in place, outputs that alias inputs or one another, RNG
state, tensor subclasses, autocast, changing shapes). On a CPU thread those wrappers cost
about 25-30 us per region and micro-batch, in F and in I together, and a cut graph has
several regions per block, where a whole compiled block has one.

A region between the calls that read parameters rarely needs any of it. Where AOTAutograd's
metadata says that none of it applies, :func:`compile_region` runs the two compiled graphs
from a plain ``torch.autograd.Function`` (:class:`_LeanRegion`): the forward graph in F, its
saved tensors kept by ``save_for_backward``, the backward graph in I, the output gradients
laid out as the backward graph was traced for. Elsewhere the region runs as inductor
returned it. Only the inductor backend, on the CPU, with grad enabled and outside autocast,
and with static shapes, is run so.

The regions of a stage compiled whole repeat one another (block k's attention core is block
j's): a region whose calls, constants and input layouts are those of one compiled before
reuses its compiled code (:data:`COMPILED_REGIONS`, the last :data:`COMPILED_REGIONS_SIZE`
compiled in the process), so a stage of n blocks compiles about as many regions as one block.

The internals of torch this reaches (inductor's compile functions, AOTAutograd's metadata)
are behind :mod:`twobp.engine.torch_internals`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx

from twobp.engine import torch_internals as internals
from twobp.engine.lru import LruCache
from twobp.engine.torch_internals import MissingTorchInternalError

_log = logging.getLogger(__name__)


@dataclass
class _Graphs:
    """The compiled graphs of one region, as inductor's inner compile saw them."""

    forward: Callable[[list[Any]], Any] | None = None
    backward: Callable[[list[Any]], Any] | None = None
    backward_graph: fx.GraphModule | None = None
    metadata: Any = None
    inference: bool = False


def _capturing(graphs: _Graphs) -> Callable[..., Any]:
    def inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        out = internals.compile_fx_inner(gm, example_inputs, **kwargs)
        if kwargs.get("is_backward"):
            graphs.backward, graphs.backward_graph = out, gm
        else:
            graphs.forward = out
            graphs.inference = bool(kwargs.get("is_inference"))
            graphs.metadata = internals.aot_forward_metadata()
        return out

    return inner_compile


def _placeholders(backward: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """The backward graph's inputs, and of them the output gradients (AOTAutograd names
    them ``tangents_<k>``; the others are what the forward saved)."""
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    return placeholders, [n for n in placeholders if n.name.startswith("tangents")]


def _why_not_lean(example_inputs: Sequence[Any], graphs: _Graphs) -> str | None:
    """Why the region's graphs cannot run from a plain Function (None: they can)."""
    meta = graphs.metadata
    if graphs.inference or None in (graphs.forward, graphs.backward, graphs.backward_graph, meta):
        return "no backward graph (no input needs a gradient)"
    assert graphs.backward_graph is not None
    if not all(isinstance(t, Tensor) for t in example_inputs):
        return "an input that is not a tensor"
    if any(t.device.type != "cpu" for t in example_inputs):
        return "an input off the CPU"
    placeholders, tangents = _placeholders(graphs.backward_graph)
    shapes = [t.shape for t in example_inputs]
    shapes += [n.meta["val"].shape for n in placeholders if isinstance(n.meta.get("val"), Tensor)]
    if not all(isinstance(d, int) for shape in shapes for d in shape):
        return "symbolic sizes"
    if any(i.mutates_data or i.mutates_metadata for i in meta.input_info):
        return "an input changed in place"
    non_alias = internals.aot_non_alias_output()
    if any(o.output_type != non_alias for o in meta.output_info):
        return "an output that aliases an input or another tensor"
    if not all(
        isinstance(o.raw_type, type) and issubclass(o.raw_type, Tensor) for o in meta.output_info
    ):
        return "an output that is not a tensor"
    plain = internals.aot_plain_tensor_meta()
    extra = (
        meta.num_intermediate_bases,
        meta.num_symints_saved_for_bw or 0,
        meta.num_opaque_objects_saved_for_bw or 0,
        len(meta.tokens),
        meta.num_backward_tokens,
        meta.num_graphsafe_rng_states,
        int(bool(meta.is_rng_op_functionalized)),
        int(any(not isinstance(m, plain) for m in meta.subclass_inp_meta)),
    )
    if any(extra):
        return "state beyond tensors (symbolic sizes, RNG, tokens, subclasses)"
    if len(tangents) != sum(o.requires_grad for o in meta.output_info):
        return "output gradients other than one per differentiable output"
    if placeholders[len(placeholders) - len(tangents) :] != tangents:
        return "output gradients before the saved tensors"
    outputs = next(n for n in graphs.backward_graph.graph.nodes if n.op == "output").args[0]
    if len(outputs) != len(example_inputs):
        return "input gradients other than one per input"
    return None


class _Lean:
    """The calling convention of one region: outputs, saved tensors, tangents' layouts."""

    def __init__(self, graphs: _Graphs) -> None:
        meta = graphs.metadata
        assert graphs.forward is not None and graphs.backward is not None
        assert graphs.backward_graph is not None
        self.forward = graphs.forward
        self.backward = graphs.backward
        self.n_outputs = len(meta.output_info)
        self.differentiable = tuple(o.requires_grad for o in meta.output_info)
        placeholders, tangents = _placeholders(graphs.backward_graph)
        self.n_saved = len(placeholders) - len(tangents)
        self.layouts = tuple(
            (tuple(t.meta["val"].shape), tuple(t.meta["val"].stride()), t.meta["val"].dtype)
            for t in tangents
        )


class _LeanRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, lean: _Lean, *inputs: Tensor) -> Any:
        outs = lean.forward(list(inputs))
        n = lean.n_outputs
        ctx.lean = lean
        ctx.save_for_backward(*outs[n : n + lean.n_saved])
        user = tuple(outs[:n])
        ctx.mark_non_differentiable(
            *(o for o, d in zip(user, lean.differentiable, strict=True) if not d)
        )
        return user

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        lean: _Lean = ctx.lean
        tangents = []
        wanted = (g for g, d in zip(grads, lean.differentiable, strict=True) if d)
        for g, (shape, stride, dtype) in zip(wanted, lean.layouts, strict=True):
            if g.stride() != stride or g.dtype != dtype:
                g = torch.empty_strided(shape, stride, dtype=dtype, device=g.device).copy_(g)
            tangents.append(g)
        input_grads = lean.backward([*ctx.saved_tensors, *tangents])
        return (None, *input_grads)


COMPILED_REGIONS_SIZE = 256
"""How many compiled regions :data:`COMPILED_REGIONS` keeps: the distinct regions of a few
models' blocks (a LLaMA-like decoder block has about 5)."""

COMPILED_REGIONS: LruCache[Any, Callable[..., Any]] = LruCache(COMPILED_REGIONS_SIZE)
"""What :func:`compile_region` made, by :func:`_key`, the most recently used kept: the
regions of a stage's blocks repeat one another (block k's attention core is block j's), so
each is compiled once. A region forgotten is compiled again the next time one like it is
(its callers keep the code they were given)."""


def _canonical(graph: fx.Graph) -> str:
    """The graph's calls with its nodes numbered in order (the names differ between regions
    of one graph: dynamo names every node of a stage's graph apart)."""
    number = {node: k for k, node in enumerate(graph.nodes)}

    def arg(a: Any) -> Any:
        return fx.map_arg(a, lambda n: f"%{number[n]}")

    def target(n: fx.Node) -> Any:
        if n.op == "placeholder":
            return None  # its name
        t = n.target
        return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{t!r}"

    return repr([(n.op, target(n), arg(n.args), arg(n.kwargs)) for n in graph.nodes])


def _key(gm: fx.GraphModule, example_inputs: Sequence[Any], config: dict[str, Any]) -> Any:
    """What a region's compiled code depends on: its graph's code, its inputs' layouts and
    which of them share storage, the mode and inductor's options; None where the graph reads
    an attribute of its module (its code would not say which value) or its sizes are
    symbolic."""
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    if not all(isinstance(t, Tensor) for t in example_inputs):
        return None
    sizes = [d for t in example_inputs for d in (*t.shape, *t.stride(), t.storage_offset())]
    if not all(isinstance(d, int) for d in sizes):
        return None  # symbolic sizes: what they stand for is not known here
    storages: dict[int, int] = {}
    layouts = tuple(
        (
            tuple(t.shape),
            tuple(t.stride()),
            t.storage_offset(),
            t.dtype,
            str(t.device),
            t.requires_grad,
            t.is_leaf,
            storages.setdefault(internals.storage_id(t), len(storages)),
        )
        for t in example_inputs
    )
    return (
        _canonical(gm.graph),
        layouts,
        repr(sorted(config.items())),
        torch.is_grad_enabled(),
        internals.autocast_enabled(),
    )


def compile_region(gm: fx.GraphModule, example_inputs: list[Any], inner: Any) -> Callable[..., Any]:
    """``gm`` (a region of a cut graph) compiled by ``inner``; by inductor, run lean where it can.

    Args:
        gm: the region's graph, as dynamo's graphs are (returns a tuple).
        example_inputs: its inputs' fake tensors.
        inner: the backend; inductor's (``torch.compile``'s wrapper of it, with the user's
            mode and options) is the one whose graphs are run directly.

    Returns:
        A callable with the signature of ``gm``.
    """
    settings = internals.inductor_settings(inner)
    if settings is None:
        return inner(gm, example_inputs)  # type: ignore[no-any-return]
    config, dynamic = settings
    if (
        any(str(k).startswith("triton.cudagraph") and v for k, v in config.items())
        or not torch.is_grad_enabled()
        or internals.autocast_enabled()
        or dynamic
    ):
        return inner(gm, example_inputs)  # type: ignore[no-any-return]
    key = _key(gm, example_inputs, config)
    made = COMPILED_REGIONS.get(key) if key is not None else None
    if made is None:
        made = _compile(gm, example_inputs, config)
        if key is not None:
            COMPILED_REGIONS.put(key, made)
    return made


def _compile(gm: fx.GraphModule, example_inputs: list[Any], config: dict[str, Any]) -> Any:
    """``gm`` compiled by inductor with ``config``, its graphs called directly where they can."""
    graphs = _Graphs()
    # Both graphs now, through the inner compile (AOTAutograd's own cache would load them
    # without it; inductor's cache of each graph still serves).
    patch = {"force_non_lazy_backward_lowering": True, "enable_autograd_cache": False}
    with internals.aot_autograd_config(**patch):
        compiled = internals.compile_fx(
            gm, example_inputs, inner_compile=_capturing(graphs), config_patches=config
        )
    try:
        why = _why_not_lean(example_inputs, graphs)
    except (AttributeError, ImportError, KeyError, TypeError, MissingTorchInternalError) as e:
        why = f"AOTAutograd's metadata is not as this code reads it ({e!r})"
    if why is not None:
        _log.debug("a region runs through AOTAutograd's wrappers: %s", why)
        return compiled
    lean = _Lean(graphs)

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return compiled(*args)
        return _LeanRegion.apply(lean, *args)  # type: ignore[no-untyped-call]

    run._twobp_lean = True  # type: ignore[attr-defined]
    return run
