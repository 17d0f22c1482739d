"""Every private torch API that the compiled engine reaches, one small function each.

Cutting a dynamo graph at the calls that read parameters (:mod:`twobp.engine.compiled`) and
calling a region's compiled graphs directly (:mod:`twobp.engine.lean_regions`) work with
dynamo, inductor and AOTAutograd from the inside: a dynamo context's backend and settings,
the frame of a module's ``_call_impl``, inductor's compile functions, AOTAutograd's metadata.
Those are torch's internals, which change between releases without notice, so they are
reached here only. Each is looked up when it is used (importing twobp needs none of them);
where it is missing, :class:`MissingTorchInternalError` says which, the torch found, and what
to do: run the blocks eagerly (``compile=False``), or install the torch named in
:data:`CHECKED_ON`.

Each function names the torch versions it was checked on.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, fx, nn

CHECKED_ON = "2.13.0"
"""The torch versions every function here was checked on."""


class MissingTorchInternalError(RuntimeError):
    """A torch internal that the compiled engine reaches is not in the installed torch."""


def _missing(where: str) -> MissingTorchInternalError:
    return MissingTorchInternalError(
        f"twobp's compiled blocks need torch's internal {where}, which torch "
        f"{torch.__version__} does not have (twobp was checked on torch {CHECKED_ON}): "
        f"run the blocks eagerly (Pipeline(compile=False), and no torch.compile of the blocks), "
        f"or install torch {CHECKED_ON}"
    )


def _reach(module: str, *names: str) -> Any:
    """``module.names[0].names[1]...``, imported and looked up now.

    Raises:
        MissingTorchInternalError: if the module or an attribute on the way is missing.
    """
    where = ".".join((module, *names))
    try:
        value: Any = importlib.import_module(module)
    except ImportError:
        raise _missing(where) from None
    for name in names:
        try:
            value = getattr(value, name)
        except AttributeError:
            raise _missing(where) from None
    return value


def _attribute(obj: Any, name: str, owner: str) -> Any:
    """``obj.name``, an internal attribute of torch's ``owner``.

    Raises:
        MissingTorchInternalError: if ``obj`` has no such attribute.
    """
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(f"{owner}.{name}") from None


# -- tensors ----------------------------------------------------------------------------------


def tensor_attribute_view(name: str) -> Callable[..., Any]:
    """The function behind the tensor attribute ``name`` (``T``, ``mT``, ``H``, ``mH``): what
    the capture sees called for ``x.T`` in eager mode. Checked on torch 2.13.0."""
    tensor_base = _reach("torch._C", "TensorBase")
    descriptor = tensor_base.__dict__.get(name)
    if descriptor is None:
        raise _missing(f"torch._C.TensorBase.{name}")
    getter: Callable[..., Any] = descriptor.__get__
    return getter


def storage_id(tensor: Tensor) -> int:
    """A number that tells the storage of ``tensor`` apart from the others alive (of fake
    tensors too). Checked on torch 2.13.0."""
    return int(_attribute(tensor.untyped_storage(), "_cdata", "UntypedStorage"))


def autocast_enabled() -> bool:
    """Whether autocast is on for any device type. Checked on torch 2.13.0."""
    return bool(_reach("torch._C", "_is_any_autocast_enabled")())


# -- modules ----------------------------------------------------------------------------------


def call_impl(module: nn.Module) -> Callable[..., Any]:
    """``module``'s ``_call_impl``: what ``module.compile()`` compiles (its hooks and forward).
    Checked on torch 2.13.0."""
    impl: Callable[..., Any] = _attribute(module, "_call_impl", "nn.Module")
    return impl


def compiled_call_impl(module: nn.Module) -> Callable[..., Any] | None:
    """What ``module.compile()`` put in place of ``module``'s call, or None (not compiled in
    place, or a torch without ``module.compile()``). Checked on torch 2.13.0."""
    impl: Callable[..., Any] | None = getattr(module, "_compiled_call_impl", None)
    return impl


def set_compiled_call_impl(module: nn.Module, impl: Callable[..., Any]) -> None:
    """Make ``module``'s call run ``impl``, as ``module.compile()`` does. Checked on torch
    2.13.0.

    Raises:
        MissingTorchInternalError: if torch's modules have no such slot.
    """
    if not hasattr(nn.Module, "_compiled_call_impl"):
        raise _missing("nn.Module._compiled_call_impl")
    module._compiled_call_impl = impl


def original_module(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (``_orig_mod``), or ``module`` itself.
    Checked on torch 2.13.0."""
    inner: nn.Module = getattr(module, "_orig_mod", module)
    return inner


# -- dynamo -----------------------------------------------------------------------------------


def dynamo_skips(function: Callable[..., Any]) -> bool:
    """Whether dynamo runs ``function``'s frame as it is rather than tracing it (torch's
    own modules). Checked on torch 2.13.0."""
    return bool(_reach("torch._dynamo.trace_rules", "check")(function))


def lookup_backend(name: str) -> Callable[..., Any]:
    """The dynamo backend registered as ``name`` (``"inductor"``, ``"aot_eager"``).
    Checked on torch 2.13.0."""
    backend: Callable[..., Any] = _reach("torch._dynamo", "lookup_backend")(name)
    return backend


def recompile_limit() -> int:
    """How many compiled variants dynamo keeps of one code before it runs it uncompiled.
    Checked on torch 2.13.0."""
    return int(_reach("torch._dynamo.config", "recompile_limit"))


def inductor_backend(mode: str | None, options: dict[str, Any] | None, dynamic: Any) -> Any:
    """Inductor as ``torch.compile(mode=, options=, dynamic=)`` passes it to dynamo.
    Checked on torch 2.13.0."""
    wrapper = _reach("torch", "_TorchCompileInductorWrapper")
    return wrapper(mode, options, dynamic, None)


def inductor_settings(backend: Any) -> tuple[dict[str, Any], Any] | None:
    """The options and ``dynamic`` of ``backend`` if it is inductor as ``torch.compile``
    passes it to dynamo (:func:`inductor_backend`), else None. Checked on torch 2.13.0."""
    config = getattr(backend, "config", None)
    if type(backend).__name__ != "_TorchCompileInductorWrapper" or not isinstance(config, dict):
        return None
    return config, getattr(backend, "dynamic", None)


def is_optimized_module(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper of a module (dynamo's
    ``OptimizedModule``); False before dynamo was imported. Checked on torch 2.13.0."""
    if "torch._dynamo" not in sys.modules:  # nothing is compiled before it loads
        return False
    return isinstance(module, _reach("torch._dynamo.eval_frame", "OptimizedModule"))


def is_disabled(context: Any) -> bool:
    """Whether the dynamo ``context`` is ``torch.compile(disable=True)``'s.
    Checked on torch 2.13.0."""
    return isinstance(context, _reach("torch._dynamo.eval_frame", "DisableContext"))


def module_context(module: nn.Module) -> Any:
    """The dynamo context of a ``torch.compile`` wrapper of a module. Checked on torch
    2.13.0."""
    return _attribute(module, "dynamo_ctx", "OptimizedModule")


def set_module_context(module: nn.Module, context: Any) -> None:
    """Make the ``torch.compile`` wrapper ``module`` compile with ``context`` from its
    next call on. Checked on torch 2.13.0."""
    _attribute(module, "dynamo_ctx", "OptimizedModule")
    module.dynamo_ctx = context
    _attribute(module, "_initialize", "OptimizedModule")()


def context_in_closure(function: Callable[..., Any]) -> Any:
    """The dynamo context of a function ``torch.compile`` returned, found in its closure,
    or None. Checked on torch 2.13.0."""
    contexts = _reach("torch._dynamo.eval_frame", "OptimizeContext")
    for cell in getattr(function, "__closure__", None) or ():
        if isinstance(cell.cell_contents, contexts):
            return cell.cell_contents
    return None


def innermost_backend(context: Any) -> Any:
    """The backend a dynamo ``context`` compiles with, out of the wrappers dynamo puts
    around it. Checked on torch 2.13.0."""
    callback = _attribute(context, "callback", "OptimizeContext")
    return _reach("torch._dynamo.eval_frame", "innermost_backend")(callback)


def context_with_backend(context: Any, backend: Callable[..., Any]) -> Any:
    """A dynamo context with ``context``'s ``fullgraph`` and ``dynamic`` that compiles
    with ``backend``. Checked on torch 2.13.0."""
    fullgraph = _attribute(context, "fullgraph", "OptimizeContext")
    dynamic = _attribute(context, "_dynamic", "OptimizeContext")
    return _reach("torch._dynamo", "optimize")(backend=backend, nopython=fullgraph, dynamic=dynamic)


# -- inductor and AOTAutograd -----------------------------------------------------------------


def compile_fx(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    inner_compile: Callable[..., Any],
    config_patches: dict[str, Any],
) -> Callable[..., Any]:
    """``gm`` compiled by inductor through AOTAutograd, each of its forward and backward
    graphs by ``inner_compile``. Checked on torch 2.13.0."""
    compile_graph = _reach("torch._inductor.compile_fx", "compile_fx")
    compiled: Callable[..., Any] = compile_graph(
        gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches
    )
    return compiled


def compile_fx_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's compile of one graph AOTAutograd made (its forward or its backward),
    ``kwargs`` as AOTAutograd passes them (``is_backward``, ``is_inference``, ...).
    Checked on torch 2.13.0."""
    return _reach("torch._inductor.compile_fx", "compile_fx_inner")(gm, example_inputs, **kwargs)


def aot_forward_metadata() -> Any:
    """AOTAutograd's metadata of the graph it compiles now (its inputs' and outputs'
    kinds), or None outside such a compile. Checked on torch 2.13.0."""
    context = _reach("torch._guards", "TracingContext").try_get()
    return getattr(context, "fw_metadata", None)


def aot_autograd_config(**values: Any) -> AbstractContextManager[Any]:
    """AOTAutograd's settings changed to ``values`` while the context lasts.
    Checked on torch 2.13.0."""
    patch: AbstractContextManager[Any] = _reach("torch._functorch.config", "patch")(values)
    return patch


def aot_non_alias_output() -> Any:
    """The output kind, in AOTAutograd's metadata, of an output that aliases nothing.
    Checked on torch 2.13.0."""
    return _reach("torch._functorch._aot_autograd.schemas", "OutputType", "non_alias")


def aot_plain_tensor_meta() -> type:
    """The class of AOTAutograd's metadata of an input that is a plain tensor (no
    subclass). Checked on torch 2.13.0."""
    plain: type = _reach("torch._functorch._aot_autograd.schemas", "PlainTensorMeta")
    return plain
