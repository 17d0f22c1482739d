"""Where a stage's forward reads its parameters: deferred operations, and everything else.

While a micro-batch's forward runs under its store, a :class:`Capture` sees
every torch function call that reads a stage parameter, whoever makes it: a
module's ``forward``, a custom module, a tied weight read through
``F.linear``, GPT-2's ``Conv1D`` calling ``torch.addmm``. A call of a covered
operation (``F.linear``, ``torch.addmm``, ``matmul``, a convolution,
``F.embedding``, a norm) whose weight operand is a stage parameter runs through
its :class:`~twobp.engine.deferred.DeferredOp`, made on first sight and kept
for every later call alike. Every other call runs as it is, and where it reads
a stage parameter (a gate multiplied elementwise, Mamba's ``A_log``) the
capture notes that autograd computes that parameter's gradient during I: the
store's report says so. Reshapes, transposes and casts of a parameter are
followed, so that an operation reading ``weight.t()`` or ``weight.to(dtype)``
is still deferred.

Two ways lead the calls to the capture, both handled by
:meth:`Capture.dispatch`:

- *the parameters' class*: for the forward, each stage parameter that
  requires a gradient becomes an instance of a subclass of ``nn.Parameter``
  whose ``__torch_function__`` is the capture (and the views of parameters it
  follows become instances of a subclass of ``Tensor``). Only calls that read
  a parameter pay for the capture; the others run at full speed. Torch's own
  lazy modules change a parameter's class the same way.
- *a torch function mode*: every call of the forward goes through it, at a few
  microseconds each. It runs the first forward of a store, where it also sees
  a covered operation reading a parameter that is not the stage's (refused by
  name), and every forward of a store whose parameters are not plain
  ``nn.Parameter`` (their class is left alone).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from twobp.engine.autocast import AutocastDtypes, maybe_autocast
from twobp.engine.deferred import DIRECT_APPLY, DeferredOp, StashSink, apply_function
from twobp.engine.operand import VIEW_STEPS, Operand
from twobp.engine.phases import TwoStageBackwardError

Captured = Tensor | str | None
"""What a capture handler returns: the output of the deferred op; or a reason
why the call is left to autograd though it reads a stage parameter; or None
when no stage parameter is an operand it could defer."""

Kwargs = dict[str, Any] | None
"""A call's keyword arguments, as the torch function mode gets them (None: none)."""

Handler = Callable[["Capture", tuple[Any, ...], Kwargs], Captured]
"""Splits one torch function's call, given its positional and keyword arguments."""


class ActiveMicrobatch(Protocol):
    """Whatever tells the capture which micro-batch is running."""

    @property
    def active_microbatch(self) -> int | None:
        """The micro-batch whose forward (or recomputation) runs now, or None."""


@dataclass
class Usage:
    """How the forwards seen so far read one parameter."""

    deferred: dict[str, int] = field(default_factory=dict)
    """Deferred uses: the operation's name and how many distinct ops of it."""
    immediate: dict[str, None] = field(default_factory=dict)
    """Uses left to autograd, each with why (an ordered set)."""


class _ForeignParameter(Exception):
    """A parameter outside the store's module is an operand of a covered operation."""

    def __init__(self, param: Tensor) -> None:
        super().__init__()
        self.param = param


_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
# fn(*args) with the torch function dispatch of tensor subclasses off (written in C++).
_call_without_subclass_dispatch = torch._C._disabled_torch_function_impl

_running: ContextVar[Capture | None] = ContextVar("twobp_running_capture", default=None)
"""The capture whose forward (or input pass) runs in this thread, like torch's grad mode."""


def running_capture() -> Capture | None:
    """The capture whose forward or input pass runs now in this thread, or None."""
    return _running.get()


def bind(
    args: tuple[Any, ...], kwargs: Kwargs, names: tuple[str, ...], defaults: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    """The arguments of a call in the order of ``names``, defaults filled in.

    Args:
        args: the positional arguments.
        kwargs: the keyword arguments.
        names: every argument's name, in order.
        defaults: the default values of the last ``len(defaults)`` arguments.

    Returns:
        The values, or None if the call does not fit (then it runs as it is).
    """
    n = len(names)
    required = n - len(defaults)
    if not kwargs:
        if len(args) == n:
            return args
        if required <= len(args) < n:
            return (*args, *defaults[len(args) - required :])
        return None
    if len(args) + len(kwargs) == n:
        # Every argument after the positional ones by keyword: how the Python
        # wrappers in torch.nn.functional hand a call on (F.rms_norm, F.embedding).
        try:
            return (*args, *[kwargs[k] for k in names[len(args) :]])
        except KeyError:
            pass
    if len(args) > n or any(k not in names[len(args) :] for k in kwargs):
        return None
    values = list(args)
    for i in range(len(args), n):
        if names[i] in kwargs:
            values.append(kwargs[names[i]])
        elif i >= required:
            values.append(defaults[i - required])
        else:
            return None
    return tuple(values)


def op_name(func: Callable[..., Any]) -> str:
    """How the report names a torch function: ``F.linear``, ``torch.addmm``, ``Tensor.mul``."""
    name: str = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # a Tensor attribute such as .T
        return f"Tensor.{getattr(getattr(func, '__self__', None), '__name__', name)}"
    module = getattr(func, "__module__", None) or ""
    qualname: str = getattr(func, "__qualname__", name)
    if module in ("torch.nn.functional", "torch._C._nn"):
        return f"F.{name}"
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if module == "torch" or qualname.startswith("_VariableFunctionsClass."):
        return f"torch.{name}"
    return f"{module}.{qualname}" if module else qualname


def _requires_grad(out: Any) -> bool:
    if isinstance(out, Tensor):
        return out.requires_grad
    if isinstance(out, (tuple, list)):
        return any(isinstance(t, Tensor) and t.requires_grad for t in out)
    return False


class Capture:
    """Routes the calls of one store's forwards that read its parameters.

    Args:
        params: ``(name, parameter)`` of the store's module, each once.
        store: read at every deferred call for the active micro-batch.
        sink: where the deferred ops hand their stashes during I.
        handlers: the covered torch functions and how each call is split.
        label: names the stage in errors.
    """

    def __init__(
        self,
        params: Iterable[tuple[str, nn.Parameter]],
        store: ActiveMicrobatch,
        sink: StashSink,
        handlers: Mapping[Callable[..., Any], Handler],
        label: str = "",
    ) -> None:
        self._store = store
        self._sink = sink
        self._handlers = handlers
        self._label = label
        self.parameters: dict[int, Operand] = {}
        """Each stage parameter as an operand read as it is, by id."""
        self.names: dict[int, str] = {}
        """The qualified name of each parameter, by id."""
        for name, p in params:
            self.parameters[id(p)] = Operand(p)
            self.names[id(p)] = name
        # Views and casts of parameters made in the running forward: the
        # tensor (weakly, its id may be reused once it dies) and what it reads.
        self._views: dict[int, tuple[weakref.ref[Tensor], Operand]] = {}
        # The ids of the parameters and of those views: one lookup per argument.
        self._watched: set[int] = set(self.parameters)
        self._by_identity: dict[tuple[Any, ...], DeferredOp] = {}
        self.ops: list[DeferredOp] = []
        """Every deferred op made so far, in the order the forwards first called them."""
        self.usage: dict[int, Usage] = {}
        """How the forwards seen so far read each parameter, by id."""
        self._autocast = AutocastDtypes()
        self.checked = False
        """A forward ran to its end under the torch function mode (which refuses
        parameters that are not the stage's); later ones change the parameters' class."""
        self._mode = _CaptureMode(self)
        self._parameter_class, self._view_class = _dispatching_classes(self.dispatch)
        # The parameters whose class the capture may change (None: some are not
        # plain nn.Parameter, so every forward runs under the mode).
        self._swappable: list[nn.Parameter] | None = [o.param for o in self.parameters.values()]
        if any(p.__class__ is not nn.Parameter for p in self._swappable):
            self._swappable = None
        # The parameters whose class the running forward changed (None: it runs
        # under the mode).
        self._swapped: list[nn.Parameter] | None = None
        # A compiled forward runs (set_aside): its calls come through dispatch only.
        self._aside = False

    # -- the way in ----------------------------------------------------------

    def begin(self) -> Token[Capture | None]:
        """Send the calls of the forward (or input pass) that starts now to :meth:`dispatch`.

        The first forward, and every forward where a parameter is not a plain
        ``nn.Parameter``, runs under the torch function mode; later ones
        change the class of the parameters that require a gradient.

        Returns:
            What :meth:`end` needs.
        """
        token = _running.set(self)
        swappable = self._swappable
        if not self.checked or swappable is None:
            self._swapped = None
        else:
            self._swapped = [p for p in swappable if p.requires_grad]
        self._install(self._swapped)
        return token

    def end(self, token: Token[Capture | None]) -> None:
        """The forward (or input pass) begun with :meth:`begin` ended, or failed."""
        _running.reset(token)
        self._withdraw(self._swapped)
        self._swapped = None
        if self._views:
            self.finish()

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Take the parameters' class and the mode away while a compiled forward runs.

        Dynamo would trace them; the compiled graph routes its calls that read
        parameters to :meth:`dispatch` itself
        (:mod:`twobp.engine.compiled`).
        """
        if self._aside:
            yield
            return
        swapped = self._swapped
        self._withdraw(swapped)
        self._aside = True
        try:
            yield
        finally:
            self._aside = False
            self._install(swapped)

    def _install(self, swapped: list[nn.Parameter] | None) -> None:
        """Route the calls: by the torch function mode (None), or the class of ``swapped``."""
        if swapped is None:
            self._mode.__enter__()  # type: ignore[no-untyped-call]
        else:
            cls = self._parameter_class
            for p in swapped:
                p.__class__ = cls

    def _withdraw(self, swapped: list[nn.Parameter] | None) -> None:
        """Undo :meth:`_install`."""
        if swapped is None:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        else:
            for p in swapped:
                p.__class__ = nn.Parameter

    def dispatch(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Kwargs = None
    ) -> Any:
        """Run one torch function call of the forward: deferred, or as it is and noted.

        Args:
            func: the torch function.
            args: its positional arguments.
            kwargs: its keyword arguments (None: none).

        Returns:
            What the call returns.

        Raises:
            TwoStageBackwardError: if a covered operation reads a parameter
                that requires a gradient and is not in the store's module.
        """
        reason = None
        handler = self._handlers.get(func)
        if handler is not None and torch.is_grad_enabled():
            try:
                out = handler(self, args, kwargs)
            except _ForeignParameter as foreign:
                raise self._foreign_error(func, foreign.param) from None
            if out is not None and out.__class__ is not str:
                return out
            reason = out
        if not kwargs:
            out = func(*args)
            read: tuple[Any, ...] = args
        else:
            out = func(*args, **kwargs)
            read = (*args, *kwargs.values())
        # Runs for every call of the forward: most read no parameter.
        watched = self._watched
        for a in read:
            if id(a) in watched or (
                (a.__class__ is list or a.__class__ is tuple) and any(id(b) in watched for b in a)
            ):
                self._observe(func, args, kwargs or {}, out, reason)
                break
        return out

    def finish(self) -> None:
        """Forget the views of the forward that ended (calls no longer reach the capture)."""
        for ref, _ in self._views.values():
            view = ref()
            if view is not None and view.__class__ is self._view_class:
                view.__class__ = Tensor
        self._watched.difference_update(self._views)
        self._views.clear()

    # -- what handlers call --------------------------------------------------

    def operand(self, t: Any) -> Operand | Literal[False] | None:
        """``t`` as a parameter operand of a covered operation.

        Returns:
            The :class:`Operand` if ``t`` is a stage parameter, or a view or
            cast of one made in this forward; None if ``t`` is None; False
            for anything else.

        Raises:
            TwoStageBackwardError: (through the mode) if ``t`` is a parameter
                that requires a gradient and is not in the store's module.
        """
        if t is None:
            return None
        found = self.parameters.get(id(t))
        if found is not None:
            return found
        view = self._views.get(id(t))
        if view is not None and view[0]() is t:
            return view[1]
        if isinstance(t, nn.Parameter) and t.requires_grad:
            raise _ForeignParameter(t)
        return False

    def run(
        self,
        op_class: type[DeferredOp],
        name: str,
        options: Any,
        x: Any,
        weight: Operand | None,
        bias: Operand | None,
        extra: Any = None,
    ) -> Captured:
        """Run one call of a covered operation through its deferred op.

        Args:
            op_class: the deferred op's class.
            name: the operation as the report names it (``"torch.addmm"``).
            options: the call's static options (hashable; part of the op's identity).
            x: the operand that is not a parameter.
            weight: the weight operand (None if the call has none).
            bias: the bias operand (None if the call has none).
            extra: per-call state passed to the op's forward.

        Returns:
            The output; None (the call runs as it is) if ``x`` is not a
            tensor or no parameter operand requires a gradient.
        """
        # Runs for every call of a covered operation: written out for speed.
        mb = self._store.active_microbatch
        if mb is None or not isinstance(x, Tensor):
            return None
        w = None if weight is None else weight.param
        b = None if bias is None else bias.param
        if not ((w is not None and w.requires_grad) or (b is not None and b.requires_grad)):
            return None
        identity = (
            name,
            options,
            None if weight is None else weight.key,
            None if bias is None else bias.key,
        )
        op = self._by_identity.get(identity)
        if op is None:
            op = self._new_op(identity, op_class, name, options, (weight, bias))
        dtype = None
        if maybe_autocast():
            dtype = self._autocast.for_call(op_class.autocast_rule, op_class.probe, x.device)
        if DIRECT_APPLY is None or _functorch_active():
            out: Tensor = apply_function(op, mb, (dtype, extra), x, w, b)
        else:  # apply_function written out: one call less
            out = DIRECT_APPLY(op, mb, (dtype, extra), _unwrap_if_dead(x), w, b)
        return out

    # -- bookkeeping ---------------------------------------------------------

    def _usage(self, param: Tensor) -> Usage:
        usage = self.usage.get(id(param))
        if usage is None:
            usage = self.usage[id(param)] = Usage()
        return usage

    def _new_op(
        self,
        key: tuple[Any, ...],
        op_class: type[DeferredOp],
        name: str,
        options: Any,
        operands: tuple[Operand | None, Operand | None],
    ) -> DeferredOp:
        op = op_class(len(self.ops), operands, options, self._sink)
        read = [o for o in operands if o is not None]
        op.name = f"{name} of {', '.join(self.names[id(o.param)] for o in read)}"
        for o in read:
            # One expert's slice w[e]: the report counts the experts whose W it concatenates.
            use = f"{name} per expert" if o.steps and o.steps[0][0] == "select" else name
            deferred = self._usage(o.param).deferred
            deferred[use] = deferred.get(use, 0) + 1
        self._by_identity[key] = op
        self.ops.append(op)
        return op

    def _resolve(self, t: Any) -> Operand | None:
        found = self.parameters.get(id(t))
        if found is not None:
            return found
        view = self._views.get(id(t))
        return view[1] if view is not None and view[0]() is t else None

    def _observe(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        reason: str | None,
    ) -> None:
        """A call that ran as it is: follow a view of a parameter, or note a use left to
        autograd."""
        step_of = VIEW_STEPS.get(func)
        if step_of is not None and isinstance(out, Tensor) and args and out is not args[0]:
            source = self._resolve(args[0])
            if source is not None:
                step = step_of(args[0], out, args)
                if step is not None:
                    self._views[id(out)] = (weakref.ref(out), source.then(step))
                    self._watched.add(id(out))
                    if self._swapped and not self._aside and out.__class__ is Tensor:
                        # Later calls reading the view reach the capture too.
                        out.__class__ = self._view_class
                    return
        if not _requires_grad(out):
            return
        read: list[Any] = []
        for a in (*args, *kwargs.values()):
            read.extend(a if isinstance(a, (list, tuple)) else (a,))
        why = reason or f"used by {op_name(func)}"
        for a in read:
            source = self._resolve(a)
            if source is not None and a is not out:
                self._usage(source.param).immediate[why] = None

    def _foreign_error(self, func: Callable[..., Any], param: Tensor) -> TwoStageBackwardError:
        where = f"{self._label}: " if self._label else ""
        mb = self._store.active_microbatch
        return TwoStageBackwardError(
            f"{where}{op_name(func)} in the forward of micro-batch {mb} reads a parameter of "
            f"shape {list(param.shape)} ({param.dtype}) that is not in the module given to "
            f"defer_weight_grads; its gradient would not reach the stage that owns it. Register "
            f"it in this stage's module (every use of a shared weight, such as tied embeddings, "
            f"must be on the stage that holds it), or freeze it with requires_grad_(False)"
        )


class _CaptureMode(TorchFunctionMode):
    """Every torch function call of the forward, to the capture."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self._dispatch = capture.dispatch

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self._dispatch(func, args, kwargs)


def _dispatching_classes(
    dispatch: Callable[[Callable[..., Any], tuple[Any, ...], Kwargs], Any],
) -> tuple[type[nn.Parameter], type[Tensor]]:
    """A subclass of ``nn.Parameter`` and one of ``Tensor`` whose torch functions go to
    ``dispatch``, with the classes' own dispatch turned off while it runs."""

    def __torch_function__(
        cls: type,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return _call_without_subclass_dispatch(dispatch, types, (func, args, kwargs), {})

    method: Any = classmethod(__torch_function__)
    parameter = type("CapturedParameter", (nn.Parameter,), {"__torch_function__": method})
    view = type("CapturedView", (Tensor,), {"__torch_function__": method})
    return parameter, view
