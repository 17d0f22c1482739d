"""Per-instance patching of covered modules' ``forward``.

A covered module keeps its class and its parameters; only its instance gets
a ``forward`` attribute that shadows the class method. While the store has an
active micro-batch and autograd is recording, that forward runs the module
through its :class:`~twobp.engine.deferred.DeferredLayer`; otherwise (no
micro-batch, ``torch.no_grad``, autocast, frozen weights, keyword arguments)
it calls the original forward, so the module behaves as if unpatched.
A deep copy of a patched module also runs the original forward.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from twobp.engine.deferred import DeferredLayer

_OWNER = "_twobp_weight_grad_store"


def _autocast_on_device(x: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def _autocast_anywhere(x: torch.Tensor) -> bool:
    return torch._C._is_any_autocast_enabled()


# Whether autocast would change the layer's computation. Where torch offers it,
# one call that answers for every device: cheaper than reading the input's
# device, and only stricter (autocast on another device also falls back to
# the plain forward, which is always correct).
_autocast = (
    _autocast_anywhere if hasattr(torch._C, "_is_any_autocast_enabled") else _autocast_on_device
)


class ActiveMicrobatch(Protocol):
    """Whatever tells the patched forward which micro-batch is running."""

    @property
    def active_microbatch(self) -> int | None:
        """The micro-batch whose forward (or recomputation) runs now, or None."""


def patched_by(module: nn.Module) -> object | None:
    """The store whose patch is installed on ``module``, or None."""
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "__func__", None), _OWNER, None)


def install_forward(layer: DeferredLayer, store: ActiveMicrobatch) -> Callable[[], None]:
    """Shadow ``layer.module.forward`` with one that defers its weight gradient.

    Args:
        layer: the covered layer; its module is patched.
        store: read at every call for the active micro-batch.

    Returns:
        A function that puts the module's previous ``forward`` back.
    """
    module = layer.module
    own_forward = module.__dict__.get("forward")
    plain: Callable[..., Any] = (
        own_forward if own_forward is not None else types.MethodType(type(module).forward, module)
    )

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Runs for every call of every covered layer: the common case (one
        # tensor, grad mode on) is tested first, with as few lookups as possible.
        mb = store.active_microbatch
        if mb is not None and self is module and len(args) == 1 and not kwargs:
            x = args[0]
            if isinstance(x, torch.Tensor) and torch.is_grad_enabled() and not _autocast(x):
                params = layer.weight_parameters()
                for p in params:
                    if p is not None and p.requires_grad:
                        return layer.run(mb, x, params)
        if self is not module:
            # A deep copy of a patched module: behave like the unpatched class.
            return type(self).forward(self, *args, **kwargs)
        return plain(*args, **kwargs)

    setattr(forward, _OWNER, store)
    module.__dict__["forward"] = types.MethodType(forward, module)

    def undo() -> None:
        if own_forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = own_forward

    return undo
