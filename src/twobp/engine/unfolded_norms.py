"""RMS norms of a compiled graph unfolded: the normalisation compiled, the weight product routed.

The capture defers a norm's weight gradient; in a cut graph
(:mod:`twobp.engine.compiled`) a routed ``torch.rms_norm`` runs eagerly, and
the region before it (a residual add, in a pre-norm block) cannot fuse with it.
Only the product with the weight has the weight gradient that W defers: the
normalisation ``x_hat = x * rsqrt(mean(x^2) + eps)`` reads no parameter. So
:func:`unfold_rms_norms` rewrites each such call into the normalisation, which
joins the region before it (fused by the compiler there, in F and in I), and
one routed call of :func:`~twobp.engine.ops.norm.rms_norm_affine`, which the
capture runs as a deferred op of ``F.rms_norm``: I is ``dY * w``, W the same
reduction over ``dY * x_hat`` as an eager norm's.

Only graphs traced without autocast, with the input and the weight in float32
or float64 (the dtype RMSNorm computes in), are unfolded, and only norms whose
normalisation joins a region of other calls (a model's final norm on a block's
input, with nothing else to compute beside it, would be a compiled region of
its own, which costs more than the eager norm); the rest keep the routed norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from twobp.engine.capture import bind
from twobp.engine.ops.norm import RMS_NORM_SIGNATURE, normalized_shape_of, rms_norm_affine

NormMode = Literal["unfolded", "routed"]
"""Whether a cut graph's RMS norms are unfolded (only the weight product routed) or routed
whole (run eagerly by the capture)."""

NORM_MODES: tuple[NormMode, ...] = ("unfolded", "routed")

_UNFOLDED_DTYPES = (torch.float32, torch.float64)


def _example(node: Any) -> Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, Tensor) else None


def _uses_autocast(gm: fx.GraphModule) -> bool:
    if torch._C._is_any_autocast_enabled():
        return True
    return any("autocast" in str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes)


def _unfoldable(node: fx.Node) -> tuple[fx.Node, tuple[int, ...], fx.Node, float] | None:
    bound = bind(tuple(node.args), dict(node.kwargs), *RMS_NORM_SIGNATURE)
    if bound is None:
        return None
    x, given_shape, weight, eps = bound
    shape = normalized_shape_of(given_shape)
    xv, wv = _example(x), _example(weight)
    if xv is None or wv is None or not isinstance(weight, fx.Node) or shape is None:
        return None
    if xv.dtype not in _UNFOLDED_DTYPES or wv.dtype != xv.dtype or tuple(wv.shape) != shape:
        return None
    if eps is None:
        eps = torch.finfo(xv.dtype).eps
    if not isinstance(eps, float):
        return None
    assert isinstance(x, fx.Node)
    return x, shape, weight, eps


def unfold_rms_norms(
    gm: fx.GraphModule,
    routed: dict[fx.Node, Callable[..., Any]],
    joins_a_region: Callable[[fx.Node, fx.Node], bool] | None = None,
) -> list[fx.Node]:
    """Unfold the routed RMS norms of ``gm`` in place (see the module doc).

    Args:
        gm: a dynamo graph.
        routed: its routed calls and their eager functions
            (:func:`~twobp.engine.compiled.routed_calls`); each unfolded norm's
            entry is replaced by its :func:`rms_norm_affine` call.
        joins_a_region: whether the normalisation of a norm (the call, its
            input) would run in a region with other calls; a norm whose
            normalisation would make a region of its own stays routed whole
            (its compiled call would cost more than the eager norm). None: every
            norm is unfolded.

    Returns:
        The routed :func:`rms_norm_affine` calls made.
    """
    norms = [n for n, f in routed.items() if f is F.rms_norm]
    if not norms or _uses_autocast(gm):
        return []
    made = []
    graph = gm.graph
    for node in norms:
        unfoldable = _unfoldable(node)
        if unfoldable is None:
            continue
        x, shape, weight, eps = unfoldable
        if joins_a_region is not None and not joins_a_region(node, x):
            continue
        dims = tuple(range(-len(shape), 0))
        with graph.inserting_before(node):
            square = graph.call_function(torch.mul, (x, x))
            mean = graph.call_function(torch.mean, (square, dims), {"keepdim": True})
            rstd = graph.call_function(torch.rsqrt, (graph.call_function(torch.add, (mean, eps)),))
            x_hat = graph.call_function(torch.mul, (x, rstd))
            x_hat.meta = dict(node.meta)
            affine = graph.call_function(rms_norm_affine, (x_hat, shape, weight))
        affine.meta = dict(node.meta)
        node.replace_all_uses_with(affine)
        graph.erase_node(node)
        del routed[node]
        routed[affine] = rms_norm_affine
        made.append(affine)
    if made:
        gm.recompile()
    return made
