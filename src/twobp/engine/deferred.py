"""The autograd Function that splits a covered layer's backward, and the layer base class.

While a micro-batch is active, a covered layer runs its forward through
:class:`DeferredWeightFunction`. The layer's real parameters are inputs of the
Function, so that its graph node exists even when the layer input needs no
gradient (the first layer of stage 0, an embedding), but the Function returns
no gradient for them: autograd accumulates nothing into their ``.grad``. Its
backward computes only the input gradient and hands what the weight gradient
needs to the store, under the micro-batch id captured at forward time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from twobp.engine.stash import SharedRows

# (micro-batch, layer index, stashed tensors) -> None
StashSink = Callable[[int, int, tuple[Tensor, ...]], None]


class DeferredLayer(ABC):
    """One covered module instance: how it runs F, I and W when its W is deferred.

    Subclasses exist per layer type (linear, convolution, ...). They read the
    module's parameters at every call, so that a parameter replaced after
    patching is still the one used; configuration such as a convolution's
    padding is read once, when the store is built.

    Args:
        index: the layer's position in its store (the key of its stashes).
        name: the module's qualified name in the patched model.
        module: the module instance.
        sink: where the input pass hands the stashed tensors.
    """

    layer_types: ClassVar[tuple[type[nn.Module], ...]]
    """The module classes this subclass covers (exact classes or subclasses
    that keep the class's ``forward``)."""

    parameter_names: ClassVar[tuple[str, ...]] = ("weight", "bias")
    """The module's parameters whose gradient W computes, in the order the
    Function takes them."""

    def __init__(self, index: int, name: str, module: nn.Module, sink: StashSink) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.sink = sink
        # What the Function's backward returns after the input gradient: no
        # gradient for the parameters (W adds it later). Built once: the
        # backward runs for every call.
        self.no_parameter_grads: tuple[None, ...] = (None,) * len(self.parameter_names)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        """Why this module instance must stay on plain autograd, or None if it can be covered."""
        return None

    def weight_parameters(self) -> tuple[nn.Parameter | None, ...]:
        """The parameters named by :attr:`parameter_names`, None where the module has none."""
        # Straight from the registry: nn.Module.__getattr__ costs microseconds per
        # call, and this runs for every layer call in F, I and W.
        return tuple(map(self.module._parameters.get, self.parameter_names))

    def run(self, mb: int, x: Tensor, params: tuple[Tensor | None, ...]) -> Tensor:
        """The module's forward for micro-batch ``mb``, with its W deferred.

        Subclasses override this to do what the module's own forward does
        around the core operation (padding, statistics bookkeeping).

        Args:
            mb: the micro-batch.
            x: the layer input.
            params: :meth:`weight_parameters`, read by the caller for this call.
        """
        return self.apply(mb, None, x, params)

    def apply(self, mb: int, options: Any, x: Tensor, params: tuple[Tensor | None, ...]) -> Tensor:
        """Run the core operation on ``x`` through :class:`DeferredWeightFunction`."""
        out: Tensor = _apply_function(self, mb, options, x, *params)
        return out

    @abstractmethod
    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], options: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        """The core operation, run without autograd.

        Args:
            x: the layer input.
            params: :meth:`weight_parameters`, in order.
            options: what :meth:`run` passed along (layer-specific).

        Returns:
            The output, the tensors the input pass needs (saved for backward)
            and any other state the input pass needs.
        """

    @abstractmethod
    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        """The input pass: the input gradient (if needed) and what W needs.

        Args:
            grad_out: gradient of the loss with respect to the output.
            saved: the tensors :meth:`forward` saved.
            state: the state :meth:`forward` returned.
            needs_input_grad: whether the input requires a gradient.

        Returns:
            The input gradient (None when not needed) and the tensors to stash.
        """

    @abstractmethod
    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        """The weight pass over stashes of any number of calls and micro-batches.

        Computes the weight gradients with as few operations as pay off (a
        matrix product concatenates stashes up to
        :data:`~twobp.engine.stash.CONCAT_ROWS` rows) and adds them into
        ``.grad`` of every parameter that requires a gradient.

        Args:
            stashes: what :meth:`input_grad` stashed, one tuple per call.
            shared: concatenations of inputs, shared with the previous layer.
        """


class DeferredWeightFunction(torch.autograd.Function):
    """Forward of a covered layer whose backward computes only the input gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, layer: DeferredLayer, mb: int, options: Any, x: Tensor, *params: Tensor | None
    ) -> Tensor:
        out, saved, state = layer.forward(x, params, options)
        ctx.layer = layer
        ctx.mb = mb
        ctx.state = state
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        layer: DeferredLayer = ctx.layer
        if torch.is_grad_enabled():
            # A checked, cheaper stand-in for @once_differentiable.
            raise RuntimeError(
                f"layer '{layer.name}': double backward (create_graph=True) through a layer "
                f"with a deferred weight gradient is not supported"
            )
        grad_in, stash = layer.input_grad(
            grad_out, ctx.saved_tensors, ctx.state, ctx.needs_input_grad[3]
        )
        layer.sink(ctx.mb, layer.index, stash)
        return (None, None, None, grad_in, *layer.no_parameter_grads)


def _direct_apply() -> Callable[..., Any] | None:
    """``DeferredWeightFunction``'s apply without the Python wrapper of ``Function.apply``.

    That wrapper costs ~20 us per call (a third of a covered layer's overhead
    in F); outside functorch transforms it only unwraps dead functorch
    wrappers and calls the C++ ``apply``. None where this torch has no such
    ``apply`` (the wrapper is used then).
    """
    descriptor = getattr(torch._C, "_FunctionBase", type).__dict__.get("apply")
    if descriptor is None or not hasattr(torch._C, "_are_functorch_transforms_active"):
        return None
    bound: Callable[..., Any] = descriptor.__get__(None, DeferredWeightFunction)
    return bound


_DIRECT_APPLY = _direct_apply()


def _apply_function(layer: DeferredLayer, mb: int, options: Any, x: Tensor, *params: Any) -> Any:
    """``DeferredWeightFunction.apply(layer, mb, options, x, *params)``, directly where it can."""
    if _DIRECT_APPLY is None or torch._C._are_functorch_transforms_active():
        return DeferredWeightFunction.apply(layer, mb, options, x, *params)  # type: ignore[no-untyped-call]
    # What Function.apply does outside transforms: a dead functorch wrapper
    # (only the layer input can be one; parameters are plain) is unwrapped first.
    return _DIRECT_APPLY(layer, mb, options, torch._C._functorch.unwrap_if_dead(x), *params)
