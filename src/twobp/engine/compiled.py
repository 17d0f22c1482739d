"""``torch.compile`` that keeps the 2-stage backward: compiled regions between captured calls.

A compiled module's forward is one dynamo graph. :func:`splitting_backend`
wraps a dynamo backend (inductor, ``aot_eager``, ...) so that the graph it
compiles is cut at every call that reads a stage parameter (``F.linear`` of
``self.fc.weight``, a norm's affine weight, a view of a weight, ``x * gate``):

- those calls run eagerly, routed through the capture of the store whose
  forward runs (:func:`~twobp.engine.capture.running_capture`), exactly as in
  an eager forward: a covered operation becomes a deferred op whose input pass
  stashes what the concatenated weight pass needs, any other use is noted in
  the store's report;
- the regions between them (activations, attention, residuals, reshapes) are
  compiled by the wrapped backend, each with its own forward and backward.

Dynamo sees one frame per module and no graph break; the compiled regions
never see the capture. Outside a store's forward (no capture runs) the routed
calls run as they are. :func:`compile_for_two_stage` compiles a module this
way; :func:`keep_two_stage` makes a module compiled by ``torch.compile``
compile this way from its next new graph on, with the backend and options the
user chose, and sets the store's capture aside while it runs.

Why the cut, rather than opaque custom operators inside one graph: the
weight pass needs the input and the output gradient of each captured call
kept past the backward; inside a compiled backward graph the output gradient
is an intermediate buffer that the compiler frees or reuses for another
buffer, and a captured call whose input needs no gradient (an embedding) has
no output the graph keeps. At the cut both are tensors the autograd engine
hands over, the same as in eager mode, and the deferred ops, their
concatenation and the report are the eager ones. Matrix products are library
calls in both, so the compiled regions lose no fusion that a single graph
would make, except across a captured norm.
"""

from __future__ import annotations

import logging
import operator
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from twobp.engine import torch_internals as internals
from twobp.engine.capture import running_capture
from twobp.engine.lean_regions import compile_region
from twobp.engine.lru import LruCache
from twobp.engine.operand import VIEW_STEPS
from twobp.engine.region_choice import (
    REGION_MODES,
    RegionChoice,
    RegionMode,
    prefer_compiled,
    time_both,
)
from twobp.engine.unfolded_norms import NORM_MODES, NormMode, unfold_rms_norms

_log = logging.getLogger(__name__)

Backend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]
"""A dynamo backend: compiles a graph for its example inputs."""

_ATTRIBUTE_VIEWS = ("T", "mT", "H", "mH")
# The dynamo graph names some calls otherwise than the torch function the
# capture sees in eager mode: dynamo inlines F.rms_norm into torch.rms_norm and
# writes `a @ b` as operator.matmul.
_EAGER_NAME: dict[Any, Callable[..., Any]] = {
    operator.matmul: torch.Tensor.__matmul__,
    torch.rms_norm: F.rms_norm,
}
# Arithmetic on a tensor reaches the capture as the Tensor method in eager mode.
_OPERATOR_METHODS: dict[Any, Callable[..., Any]] = {
    operator.add: torch.Tensor.add,
    operator.sub: torch.Tensor.sub,
    operator.mul: torch.Tensor.mul,
    operator.truediv: torch.Tensor.div,
    operator.neg: torch.Tensor.neg,
    operator.pow: torch.Tensor.pow,
}


_IN_PLACE_OPERATORS = {
    operator.setitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.ipow,
    operator.imod,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
}
_NOT_CALLS = ("placeholder", "get_attr", "output")
_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson")

_compiled_graph_ran: ContextVar[list[bool] | None] = ContextVar(
    "twobp_compiled_graph_ran", default=None
)
"""Set by a cut graph when it runs, for the compiled module's call that waits on it."""


def _marking_run(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, noting that a cut graph ran (dynamo did not run the frame uncompiled)."""

    def run(*args: Any) -> Any:
        ran = _compiled_graph_ran.get()
        if ran is not None:
            ran[0] = True
        return forward(*args)

    return run


class _Routed:
    """One call of a compiled module's graph that reads a stage parameter, run eagerly.

    Through the running capture (deferred, or noted as a use left to
    autograd), or as it is when no store's forward runs.
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.__name__ = f"routed_{getattr(func, '__name__', 'call').strip('_')}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture = running_capture()
        if capture is None or not torch.is_grad_enabled():
            return self.func(*args, **kwargs)
        return capture.dispatch(self.func, args, kwargs or None)


class _Region:
    """A region of the cut graph, as the graph of the routed calls calls it: compiled, or
    eagerly (its own graph's code), or chosen by timing both on its first call."""

    def __init__(
        self,
        compiled: Callable[..., Any],
        eager: Callable[..., Any],
        choice: RegionChoice,
        mode: RegionMode,
    ) -> None:
        self.compiled = compiled
        self.eager = eager
        self.choice = choice
        self.run: Callable[..., Any] | None = None
        if mode != "measured":
            self._settle(mode)
        self.__name__ = choice.name
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def _settle(self, mode: Literal["compiled", "eager"]) -> None:
        self.choice.mode = mode
        self.run = self.compiled if mode == "compiled" else self.eager

    def __call__(self, *args: Any) -> Any:
        run = self.run
        if run is None:
            eager_s, compiled_s = time_both(self.eager, self.compiled, args)
            self.choice.eager_s, self.choice.compiled_s = eager_s, compiled_s
            self._settle("compiled" if prefer_compiled(eager_s, compiled_s) else "eager")
            _log.info(
                "%s (%d calls): eager %.0f us, compiled %.0f us%s: runs %s",
                self.choice.name,
                self.choice.ops,
                eager_s * 1e6,
                compiled_s * 1e6,
                " (its graphs called directly)" if self.choice.lean else "",
                self.choice.mode,
            )
            run = self.run
            assert run is not None
        return run(*args)


def _eager_function(node: fx.Node) -> Callable[..., Any] | None:
    """The torch function an eager forward would hand the capture for ``node``."""
    if node.op == "call_method":
        method: Callable[..., Any] | None = getattr(torch.Tensor, str(node.target), None)
        return method
    if node.op != "call_function":
        return None
    target = node.target
    if target is getattr and len(node.args) == 2 and node.args[1] in _ATTRIBUTE_VIEWS:
        return internals.tensor_attribute_view(str(node.args[1]))
    if target is getattr:
        return None
    eager = _EAGER_NAME.get(target)
    if eager is not None:
        return eager
    method = _OPERATOR_METHODS.get(target)
    first = node.args[0] if node.args else None
    if isinstance(first, fx.Node) and isinstance(first.meta.get("example_value"), Tensor):
        return method or target  # type: ignore[return-value]
    return target  # type: ignore[return-value]


def _parameter_nodes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> set[fx.Node]:
    """The placeholders (and attributes) of ``gm`` that hold module parameters."""
    found: set[fx.Node] = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs, strict=False):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        if isinstance(value, nn.Parameter) or isinstance(example, nn.Parameter):
            found.add(node)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, nn.Parameter):
                found.add(node)
    return found


def routed_calls(
    gm: fx.GraphModule, example_inputs: Sequence[Any]
) -> dict[fx.Node, Callable[..., Any]]:
    """The calls of ``gm`` that read a parameter (or a view of one), with their eager function.

    A reshape, transpose or cast of a parameter is routed too, and calls
    reading its result are then calls reading a parameter.
    """
    reads_parameter = _parameter_nodes(gm, example_inputs)
    routed: dict[fx.Node, Callable[..., Any]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if not any(i in reads_parameter for i in node.all_input_nodes):
            continue
        func = _eager_function(node)
        if func is None:
            continue
        routed[node] = func
        if func in VIEW_STEPS:
            reads_parameter.add(node)
    return routed


class _Run:
    """A run of consecutive nodes between routed calls, compiled as one graph."""

    def __init__(self) -> None:
        self.nodes: list[fx.Node] = []
        self.inputs: list[fx.Node] = []
        self.outputs: list[fx.Node] = []

    def close(self) -> None:
        members = set(self.nodes)
        seen: set[fx.Node] = set()
        for node in self.nodes:
            for i in node.all_input_nodes:
                if i not in members and i not in seen:
                    seen.add(i)
                    self.inputs.append(i)
        self.outputs = [n for n in self.nodes if any(u not in members for u in n.users)]

    def graph_module(self, root: fx.GraphModule) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for i in self.inputs:
            env[i] = graph.placeholder(i.name)
            env[i].meta = dict(i.meta)
        for node in self.nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in self.outputs))
        return fx.GraphModule(root, graph)


def _order_sensitive(node: fx.Node) -> bool:
    """Whether moving ``node`` past another call could change what the graph computes:
    an in-place change, a random draw, a side effect."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.is_impure() or node.target in _IN_PLACE_OPERATORS:
        return True
    name = str(getattr(node.target, "__name__", node.target))
    return (name.endswith("_") and not name.endswith("__")) or any(
        word in name for word in _RANDOM_WORDS
    )


def _phases(
    gm: fx.GraphModule, routed: dict[fx.Node, Callable[..., Any]]
) -> tuple[dict[fx.Node, int], bool]:
    """The phase of every call of ``gm``: phase k runs its routed calls, then one region.

    Each call goes to the earliest phase its inputs allow (a routed call after
    the region whose output it reads, a region's call with the routed calls it
    reads), so that independent routed calls (``wq``, ``wk``, ``wv`` of one
    input) run one after another and the calls between them join one region.
    Routed calls keep their order (the capture sees them as in eager mode). A
    graph with an in-place change, a random draw or a side effect keeps its
    order: each region is then a run of consecutive calls.

    Returns:
        The phase of each call, and whether the graph was reordered.
    """
    calls = [n for n in gm.graph.nodes if n.op not in _NOT_CALLS]
    if any(_order_sensitive(n) for n in calls):
        phase, k = {}, 0
        for node, previous in zip(calls, [None, *calls], strict=False):
            if previous is not None and (node in routed) != (previous in routed):
                k += node in routed
            phase[node] = k
        return phase, False
    phase = {}
    last_routed = 0
    for node in calls:
        is_routed = node in routed
        level = last_routed if is_routed else 0
        for i in node.all_input_nodes:
            if i in phase:
                level = max(level, phase[i] + (is_routed and i not in routed))
        phase[node] = level
        if is_routed:
            last_routed = level
    return phase, True


def _joins_a_region(
    gm: fx.GraphModule, routed: dict[fx.Node, Callable[..., Any]]
) -> Callable[[fx.Node, fx.Node], bool]:
    """For :func:`~twobp.engine.unfolded_norms.unfold_rms_norms`: whether calls computed from a
    routed call's input ``x`` alone would run in a region with other calls of ``gm``
    (outside ``routed``), rather than in a region of their own."""
    phase, reordered = _phases(gm, routed)
    calls = [n for n in gm.graph.nodes if n.op not in _NOT_CALLS]
    if reordered:
        # A call reading only x goes to x's phase (0 for a graph input), where it runs
        # in that phase's region with the other calls of the phase outside `routed`.
        levels = {phase[n] for n in calls if n not in routed}
        return lambda node, x: phase.get(x, 0) in levels
    # In source order the call would run in the region of the calls just before `node`.
    before = dict(zip(calls, [None, *calls], strict=False))
    return lambda node, x: (previous := before.get(node)) is not None and previous not in routed


def split_at_routed_calls(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    inner: Backend,
    regions: RegionMode = "compiled",
    choices: list[RegionChoice] | None = None,
    norms: NormMode = "unfolded",
) -> Callable[..., Any]:
    """``gm`` with the calls that read parameters routed and every region between compiled.

    Args:
        gm: the dynamo graph of a module's forward.
        example_inputs: its example inputs, as dynamo hands them to a backend.
        inner: compiles each region.
        regions: how the regions run (:data:`~twobp.engine.region_choice.RegionMode`).
        choices: where to note each region's :class:`RegionChoice`.
        norms: whether the RMS norms are unfolded, their normalisation joining
            the region before them and only the weight product routed
            (``"unfolded"``, :mod:`twobp.engine.unfolded_norms`), or routed whole.

    Returns:
        A callable with the signature of ``gm``.
    """
    routed = routed_calls(gm, example_inputs)
    if not routed:
        return inner(gm, example_inputs)
    if norms == "unfolded":
        unfold_rms_norms(gm, routed, _joins_a_region(gm, routed))
    phase, _ = _phases(gm, routed)
    calls = [n for n in gm.graph.nodes if n.op not in _NOT_CALLS]
    order = sorted(range(len(calls)), key=lambda k: (phase[calls[k]], calls[k] not in routed, k))
    by_phase: dict[int, _Run] = {}
    region_of: dict[fx.Node, _Run] = {}
    for k in order:
        node = calls[k]
        if node not in routed:
            region = by_phase.setdefault(phase[node], _Run())
            region.nodes.append(node)
            region_of[node] = region
    for region in by_phase.values():
        region.close()

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    emitted: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    for k in order:
        node = calls[k]
        if node in routed:
            args = fx.map_arg(node.args, lambda n: env[n])
            kwargs = fx.map_arg(node.kwargs, lambda n: env[n])
            if node.op == "call_function" and node.target is getattr:
                args = args[:1]
            env[node] = graph.call_function(_Routed(routed[node]), args, kwargs)
            continue
        region = region_of[node]
        if id(region) in emitted:
            continue
        emitted.add(id(region))
        sub = region.graph_module(gm)
        examples = [i.meta.get("example_value") for i in region.inputs]
        choice = RegionChoice(f"compiled_region_{len(emitted)}", len(region.nodes))
        if choices is not None:
            choices.append(choice)
        compiled = sub.forward if regions == "eager" else compile_region(sub, examples, inner)
        choice.lean = bool(getattr(compiled, "_twobp_lean", False))
        call = graph.call_function(
            _Region(compiled, sub.forward, choice, regions), tuple(env[i] for i in region.inputs)
        )
        for j, out in enumerate(region.outputs):
            env[out] = graph.call_function(operator.getitem, (call, j))
    for node in gm.graph.nodes:
        if node.op == "output":
            graph.node_copy(node, lambda n: env[n])
    split = fx.GraphModule(gm, graph)
    return _marking_run(split.forward)


class SplittingBackend:
    """A dynamo backend that cuts graphs at the calls reading parameters (see the module doc).

    Two of them with equal inner backends are equal, as torch's own backend
    wrappers are, so that blocks of one class compiled one by one share
    dynamo's compiled code instead of counting against its recompile limit.

    Args:
        inner: the backend that compiles the regions between those calls: a
            backend's name or a callable.
        regions: how the regions run: each the faster of compiled and eager,
            timed on its first call (``"measured"``), all compiled, or all eager.
        norms: ``"unfolded"`` (an RMS norm's normalisation in the region before
            it, only its weight product routed) or ``"routed"`` (the whole norm).

    Raises:
        ValueError: if ``regions`` or ``norms`` is none of those.
    """

    _twobp_splitting = True

    def __init__(
        self,
        inner: Backend | str = "inductor",
        regions: RegionMode = "measured",
        norms: NormMode = "unfolded",
    ) -> None:
        if regions not in REGION_MODES:
            raise ValueError(
                f"regions={regions!r}: pass one of {', '.join(map(repr, REGION_MODES))}"
            )
        if norms not in NORM_MODES:
            raise ValueError(f"norms={norms!r}: pass one of {', '.join(map(repr, NORM_MODES))}")
        self.inner = inner
        self.regions: RegionMode = regions
        self.norms: NormMode = norms
        self.choices: list[RegionChoice] = []
        """Every region of the graphs compiled so far, and how it runs."""
        self._compile_region: Backend = (
            internals.lookup_backend(inner) if isinstance(inner, str) else inner
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return split_at_routed_calls(
            gm, example_inputs, self._compile_region, self.regions, self.choices, self.norms
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SplittingBackend)
            and bool(self.inner == other.inner)
            and self.regions == other.regions
            and self.norms == other.norms
        )

    def __hash__(self) -> int:
        return hash(type(self))


def splitting_backend(
    inner: Backend | str = "inductor",
    regions: RegionMode = "measured",
    norms: NormMode = "unfolded",
) -> SplittingBackend:
    """A :class:`SplittingBackend` around ``inner`` (a backend's name or a callable)."""
    return SplittingBackend(inner, regions, norms)


class _SettingCaptureAside:
    """A compiled module's forward, called with the running capture's parameter classes
    and mode set aside (dynamo would trace them), routed calls still reaching it.

    Where dynamo runs the frame uncompiled (past its recompile limit, or with
    compiling disabled), nothing routes the block's calls to the capture: its
    weight gradients are computed during I. That is warned once per module.
    """

    def __init__(self, compiled: Callable[..., Any], module: nn.Module) -> None:
        self.compiled = compiled
        self._module = weakref.ref(module)
        self._warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture = running_capture()
        if capture is None:
            return self.compiled(*args, **kwargs)
        ran = [False]
        token = _compiled_graph_ran.set(ran)
        try:
            with capture.set_aside():
                out = self.compiled(*args, **kwargs)
        finally:
            _compiled_graph_ran.reset(token)
        if not ran[0] and not self._warned and torch.is_grad_enabled():
            self._warned = True
            warnings.warn(self._uncompiled_message(capture), stacklevel=2)
        return out

    def _uncompiled_message(self, capture: Any) -> str:
        module = self._module()
        inner = internals.original_module(module) if module is not None else None
        name = f"block {type(inner).__name__}"
        where = f"{capture._label}: " if getattr(capture, "_label", "") else ""
        for relative, p in inner.named_parameters() if inner is not None else ():
            full = capture.names.get(id(p))
            if full is not None and full.endswith(relative):
                prefix = full[: -len(relative)].rstrip(".")
                if prefix:
                    name = f"block '{prefix}' ({type(inner).__name__})"
                elif inner is not None and len(children := list(inner.children())) > 1:
                    name = f"stage ({type(inner).__name__} of {len(children)} blocks)"
                break
        limit = internals.recompile_limit()
        return (
            f"{where}the compiled {name} ran uncompiled: dynamo ran its frame as plain "
            f"Python (past torch._dynamo.config.recompile_limit = {limit} compiled variants of "
            f"its code, or with compiling disabled), so its weight gradients are computed "
            f"during I instead of deferred to W (gradients stay exact). Keep the variants of a "
            f"block class below the limit (input shapes: compile with dynamic=True; "
            f"torch._dynamo.reset() between unrelated models in one process) or raise "
            f"torch._dynamo.config.recompile_limit; TORCH_LOGS=recompiles shows why it "
            f"recompiled"
        )


def compile_for_two_stage(module: nn.Module, **options: Any) -> nn.Module:
    """Compile ``module`` in place (``module.compile(**options)``) so that 2BP keeps deferring.

    Its parameters keep their names (no ``_orig_mod.`` as with
    ``torch.compile(module)``), so that checkpoints and the ranks' model
    check read the same as in eager mode.

    Args:
        module: the module (a pipeline block, a stage).
        options: ``torch.compile``'s keyword arguments; ``backend`` (default
            inductor, with ``mode`` and ``options``) compiles the regions
            between the calls that read parameters. Two more: ``regions``
            (``"measured"``, ``"compiled"``, ``"eager"``) says how those
            regions run, ``norms`` (``"unfolded"``, ``"routed"``) whether an
            RMS norm's normalisation is compiled with the region before it
            (:class:`SplittingBackend`).

    Returns:
        ``module``.
    """
    inner = options.pop("backend", "inductor")
    if inner == "inductor":
        inner = internals.inductor_backend(
            options.pop("mode", None), options.pop("options", None), options.get("dynamic")
        )
    regions = options.pop("regions", "measured")
    norms = options.pop("norms", "unfolded")
    backend = splitting_backend(inner, regions, norms)
    compiled = torch.compile(_inline(module), backend=backend, **options)
    internals.set_compiled_call_impl(module, _set_aside_around(compiled, module))
    return module


FRAME_CODES_SIZE = 64
"""How many frame codes :data:`FRAME_CODES` keeps: one per class of torch container and
classes of its children compiled in the process (a handful per model)."""


class FrameCodes:
    """The code of the frame around a torch container's ``_call_impl``, by the container's
    class and its children's classes (see :func:`_inline`); the :data:`FRAME_CODES_SIZE`
    most recently used.

    Containers of one key share a code, and so dynamo's compiled code for it. A key whose
    code was forgotten gets a new one, under a new name: containers compiled from then on
    compile again (and count against that code's recompile limit, not the old one's).
    """

    def __init__(self, size: int = FRAME_CODES_SIZE) -> None:
        self._codes: LruCache[tuple[type, ...], types.CodeType] = LruCache(size)
        self._made = 0  # never reset: no two codes alive in one process share a name

    def code(self, key: tuple[type, ...], template: types.CodeType) -> types.CodeType:
        """The code of ``key``'s frame: ``template`` under a name of its own, made once."""
        code = self._codes.get(key)
        if code is None:  # a name of its own: dynamo tells codes apart by their text
            code = template.replace(co_name=f"inline_{key[0].__name__}_{self._made}")
            self._made += 1
            self._codes.put(key, code)
        return code

    def clear(self) -> None:
        """Forget every code (containers compiled from now on get new ones)."""
        self._codes.clear()

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a code now (without making it the most recently used)."""
        return key in self._codes

    def __len__(self) -> int:
        return len(self._codes)


FRAME_CODES = FrameCodes()
"""The frame codes of the containers compiled in this process (:class:`FrameCodes`)."""


def _inline(module: nn.Module) -> Callable[..., Any]:
    """What to compile for ``module`` in place, as ``module.compile()`` does: its
    ``_call_impl``, whose forward frame dynamo catches and shares between modules of one
    class. Torch's own modules (``nn.Sequential``, a pipeline's stage) have frames dynamo
    skips: their ``_call_impl`` goes behind a frame it traces, whose code is shared by the
    containers of the same classes of children (their compiled code is the same, and
    containers of other blocks do not count against the recompile limit of one code)."""
    forward = module.forward
    call: Callable[..., Any] = internals.call_impl(module)
    if isinstance(forward, types.MethodType) and internals.dynamo_skips(forward):

        def inline(*args: Any, **kwargs: Any) -> Any:
            return call(*args, **kwargs)

        key = (type(module), *(type(child) for child in module.children()))
        inline.__code__ = FRAME_CODES.code(key, inline.__code__)
        return inline
    return call


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is compiled: a ``torch.compile`` wrapper, or compiled in place."""
    return internals.is_optimized_module(module) or internals.compiled_call_impl(module) is not None


def _splitting_context(context: Any) -> Any:
    """A dynamo context like ``context`` (fullgraph, dynamic), its backend wrapped to split."""
    backend = internals.innermost_backend(context)
    # torch.compile(backend=callable) wraps the callable in a _TorchCompileWrapper.
    if getattr(getattr(backend, "compiler_fn", backend), "_twobp_splitting", False):
        return context
    return internals.context_with_backend(context, splitting_backend(backend))


def _set_aside_around(compiled: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    forward = _SettingCaptureAside(compiled, module)
    forward._twobp_keeps_two_stage = True  # type: ignore[attr-defined]
    return forward


def keep_two_stage(module: nn.Module) -> None:
    """Make a compiled module keep 2BP: graphs cut at the calls reading parameters.

    Its backend (and ``fullgraph``, ``dynamic``) stay the user's; only graphs
    compiled from now on are cut. Nothing happens to a module already made so,
    nor to one compiled with ``disable=True``.

    Args:
        module: a ``torch._dynamo.OptimizedModule`` (``torch.compile(module)``)
            or a module compiled in place (``module.compile()``).

    Raises:
        MissingTorchInternalError: if the installed torch lacks an internal this reaches
            (:mod:`twobp.engine.torch_internals`).
    """
    if internals.is_optimized_module(module):
        if getattr(module.forward, "_twobp_keeps_two_stage", False):
            return
        current = internals.module_context(module)
        if internals.is_disabled(current):
            return
        context = _splitting_context(current)
        if context is not current:
            internals.set_module_context(module, context)
        module.forward = _set_aside_around(module.forward, module)  # type: ignore[method-assign]
        return
    compiled = internals.compiled_call_impl(module)
    if compiled is None or getattr(compiled, "_twobp_keeps_two_stage", False):
        return
    context = internals.context_in_closure(compiled)
    if context is None or internals.is_disabled(context):
        return
    compiled = _splitting_context(context)(_inline(module))
    internals.set_compiled_call_impl(module, _set_aside_around(compiled, module))


def compiled_modules(module: nn.Module) -> list[nn.Module]:
    """The compiled modules in ``module``'s tree (``module`` itself included)."""
    return [m for m in module.modules() if is_compiled(m)]
