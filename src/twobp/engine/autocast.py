"""The dtype in which ``torch.autocast`` would run a deferred operation.

A deferred op runs F, I and W itself, so it must cast its operands as
autocast would have: matrix products and convolutions run in autocast's
lower-precision dtype, embeddings in the weight's own dtype, and norms in
float32 on some devices and unchanged on others (CUDA lists ``layer_norm``
among its float32 operations, the CPU does not). For the norms the store asks
autocast itself, once per device type and dtype, with a tiny call.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
from torch import Tensor


class AutocastRule(Enum):
    """How autocast treats an operation's floating operands."""

    LOWER = "lower"
    """Cast to autocast's dtype (matrix products, convolutions)."""
    UNCHANGED = "unchanged"
    """Left as they are (embedding)."""
    PROBED = "probed"
    """Float32 on some devices, unchanged on others: asked of autocast (norms)."""


def _unknown() -> bool:
    return True


maybe_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", _unknown)
"""False when autocast is surely off on every device: one cheap call answers the
common case where torch offers it (else :meth:`AutocastDtypes.for_call` asks)."""


class AutocastDtypes:
    """The dtype each deferred op casts its operands to, under the autocast state of the call.

    One per store: it remembers what autocast answered for probed operations.
    """

    def __init__(self) -> None:
        self._probed: dict[tuple[object, str, torch.dtype], torch.dtype | None] = {}

    def for_call(
        self,
        rule: AutocastRule,
        probe: Callable[[torch.device, torch.dtype], Tensor],
        device: torch.device,
    ) -> torch.dtype | None:
        """The dtype to cast the operands of a call on ``device`` to, or None for no cast.

        Args:
            rule: the operation's :class:`AutocastRule`.
            probe: a tiny call of the operation (for :attr:`AutocastRule.PROBED`).
            device: where the call runs.
        """
        if not maybe_autocast() or not torch.is_autocast_enabled(device.type):
            return None
        if rule is AutocastRule.UNCHANGED:
            return None
        lower = torch.get_autocast_dtype(device.type)
        if rule is AutocastRule.LOWER:
            return lower
        key = (probe, device.type, lower)
        if key not in self._probed:
            with torch.no_grad():
                out = probe(device, lower)
            self._probed[key] = torch.float32 if out.dtype == torch.float32 else None
        return self._probed[key]


def check_autocast_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Check that ``device`` can run ``torch.autocast`` with ``dtype``.

    Args:
        device: the device that would run the forward.
        dtype: the lower-precision dtype asked for.

    Raises:
        ValueError: if autocast does not support ``dtype`` on this device
            type, or the device cannot run a matrix product in it.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast takes torch.bfloat16 or torch.float16, not {dtype}")
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"torch.autocast is not available on device type '{device.type}'")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device} does not support bfloat16; use autocast=torch.float16")
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
            a = torch.ones(2, 2, device=device)
            out = a @ a
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{device} cannot run autocast with {dtype}: {error}") from error
    if out.dtype != dtype:
        raise ValueError(
            f"torch.autocast('{device.type}', dtype={dtype}) runs matrix products in "
            f"{out.dtype} on this device, not {dtype}"
        )
