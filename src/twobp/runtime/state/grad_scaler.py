"""Loss scaling for float16 that every rank of a pipeline agrees on.

In float16 small gradients underflow to zero; a loss scale multiplies the loss
(and so every gradient) before the backward and divides the gradients again
before the optimizer step. With a dynamic scale an overflow (an infinite or
NaN gradient) skips the step and lowers the scale. ``torch.amp.GradScaler``
does this for one process; in a pipeline each rank holds only its stages'
gradients, so a rank that looked only at its own would step while another
skips, and the copies of the model would drift apart.

:class:`GradScaler` has torch's arguments and methods. Given to
``Pipeline(..., grad_scaler=scaler)``, the pipeline multiplies every
micro-batch's loss by the scale before its backward (I and W both see scaled
gradients), and :meth:`GradScaler.unscale_` decides whether any gradient
anywhere is not finite by one all-reduce over every rank of the pipeline and
its data-parallel copies. Every rank then skips or steps together, and
:meth:`GradScaler.update` moves the scale identically everywhere. The scale
and its growth tracker are float32 and int32 tensors updated by torch's own
kernels, as ``torch.amp.GradScaler`` does, so the scale sequence is the one
a single process would see. An overflow is then a skipped step, not a
``NonFiniteLossError`` (a loss that is not finite itself still follows the
pipeline's ``nonfinite``); ``Pipeline.step`` returns the unscaled mean loss.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from twobp.runtime.base.group import Membership
from twobp.runtime.communication import collective


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    found_inf: Tensor | None = None
    """Non-zero if some gradient of some rank was not finite (agreed by every rank)."""


@dataclass(frozen=True)
class _Binding:
    """Where the scaler's agreement runs: the pipeline's ranks (all copies), its device."""

    owner: weakref.ref[Any]
    members: Membership
    device: torch.device
    timeout: float


class GradScaler:
    """``torch.amp.GradScaler`` for a pipeline: the ranks agree on every overflow.

    Pass it to ``Pipeline(..., grad_scaler=scaler)``, then train as with torch's::

        scaler = twobp.GradScaler()
        pipe = Pipeline(blocks, loss_fn, autocast=torch.float16, grad_scaler=scaler)
        loss = pipe.step(x, y)          # the loss is scaled inside; returns it unscaled
        scaler.unscale_(optimizer)      # optional: to clip the unscaled gradients
        pipe.clip_grad_norm_(1.0)
        scaler.step(optimizer)          # skipped on every rank if any gradient overflowed
        scaler.update()                 # the same new scale on every rank
        pipe.zero_grad()

    Every rank calls :meth:`unscale_` (or :meth:`step`) for its optimizer, the
    same number of times: each call is one collective. The optimizer may be
    any over this rank's parameters, a sharded one too: the scaler reads the
    gradients of the parameters in its ``param_groups``.

    Args:
        device: accepted for ``torch.amp.GradScaler``'s signature; the scale
            lives on the device of the pipeline it is given to.
        init_scale: the scale to start with.
        growth_factor: what the scale is multiplied by after
            ``growth_interval`` steps in a row without an overflow (at least 1).
        backoff_factor: what the scale is multiplied by after a step with an
            overflow (in ``(0, 1]``). ``growth_factor=1`` and ``backoff_factor=1``
            keep a static scale (a step with an overflow is still skipped).
        growth_interval: steps without an overflow before the scale grows.
        enabled: False makes every method a pass-through (``step`` steps the
            optimizer, ``get_scale`` is 1.0), and the pipeline scales nothing.

    Raises:
        ValueError: if a factor or the interval is out of range.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._enabled = bool(enabled)
        self._device_name = device
        if self._enabled:
            _check_factors(init_scale, growth_factor, backoff_factor, growth_interval)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        self._scale: Tensor | None = None
        self._growth_tracker: Tensor | None = None
        self._binding: _Binding | None = None
        self._per_optimizer: dict[int, _OptimizerState] = defaultdict(_OptimizerState)
        self.last_step_skipped = False
        """True if the last :meth:`step` skipped the optimizer's step because some
        gradient on some rank was not finite (the same on every rank)."""

    # -- the pipeline's side ---------------------------------------------------------

    def belongs_elsewhere(self, owner: object) -> bool:
        """True if the scaler is attached to a pipeline other than ``owner`` that still exists."""
        if self._binding is None:
            return False
        other = self._binding.owner()
        return other is not None and other is not owner

    def bind(
        self, owner: object, members: Membership, device: torch.device, timeout: float
    ) -> None:
        """Attach the scaler to the pipeline ``owner`` (``Pipeline`` calls this).

        Raises:
            ValueError: if it is attached to another pipeline that is still open.
        """
        if self.belongs_elsewhere(owner):
            raise ValueError(
                "this GradScaler belongs to another pipeline; close that one first, or give "
                "each pipeline its own GradScaler"
            )
        self._binding = _Binding(weakref.ref(owner), members, device, float(timeout))
        if self._scale is not None:
            self._scale = self._scale.to(device)
            assert self._growth_tracker is not None
            self._growth_tracker = self._growth_tracker.to(device)

    def unbind(self, owner: object) -> None:
        """Detach the scaler from ``owner`` (the pipeline closes); it may be given to another."""
        if self._binding is not None and self._binding.owner() is owner:
            self._binding = None

    def loss_scale(self) -> float:
        """What the pipeline multiplies every micro-batch's loss by: the scale, or 1."""
        return self.get_scale()

    # -- torch.amp.GradScaler's methods ----------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or an iterable of tensors) multiplied by the scale.

        The pipeline scales its losses itself; this is for a loss computed
        outside it, as with ``torch.amp.GradScaler``.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * self._scale_tensor().to(outputs.device)
        if isinstance(outputs, Iterable):
            scaled = [self.scale(o) for o in outputs]
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, and agree on overflows. Collective.

        Every rank of the pipeline and of its copies calls it for its
        optimizer; one all-reduce tells all of them whether any gradient
        anywhere is infinite or NaN. Optional before :meth:`step` (which
        calls it), needed to clip the unscaled gradients
        (``pipe.clip_grad_norm_``) or look at them.

        Raises:
            RuntimeError: if called twice for the optimizer before :meth:`update`,
                or after :meth:`step`; if the scaler was not given to a pipeline.
            ValueError: if a gradient is float16 (the parameters must be float32:
                use ``Pipeline(autocast=torch.float16)`` rather than a float16 model).
        """
        if not self._enabled:
            return
        binding = self._bound("unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        scale = self._scale_tensor()
        # As torch: the reciprocal in float64, so that it is exact for powers of two.
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=binding.device)
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if grad.dtype == torch.float16:
                        raise ValueError(
                            "Attempting to unscale FP16 gradients: keep the parameters float32 "
                            "and compute in float16 with Pipeline(autocast=torch.float16)"
                        )
                    values = grad._values() if grad.is_sparse else grad
                    groups[(values.device, values.dtype)].append(values)
            for (device, _), grads in groups.items():
                here = found_inf if device == found_inf.device else found_inf.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inv_scale.to(device))
                if here is not found_inf:
                    found_inf.copy_(torch.maximum(found_inf, here.to(found_inf.device)))
        collective.all_reduce(
            binding.members,
            found_inf,
            dist.ReduceOp.MAX,
            binding.timeout,
            "whether any gradient overflowed",
            where="in GradScaler.unscale_",
        )
        state.found_inf = found_inf
        state.stage = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` did) and step the optimizer, on every rank or none.

        ``args`` and ``kwargs`` go to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or None if the step was skipped
            (see :attr:`last_step_skipped`).

        Raises:
            RuntimeError: if called twice before :meth:`update`, or with a closure.
        """
        if not self._enabled:
            self.last_step_skipped = False
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._bound("step")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        assert state.found_inf is not None
        state.stage = _Stage.STEPPED
        # Every rank holds the same agreed value: all step, or all skip.
        self.last_step_skipped = bool(state.found_inf.item())
        if self.last_step_skipped:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Move the scale: back off after an overflow, grow after ``growth_interval`` steps.

        Every rank computes the same new scale from the agreed overflow.
        ``new_scale`` sets it instead (give every rank the same).

        Raises:
            RuntimeError: if no :meth:`unscale_` or :meth:`step` ran since the last update.
        """
        if not self._enabled:
            return
        self._bound("update")
        scale = self._scale_tensor()
        assert self._growth_tracker is not None
        if new_scale is not None:
            if isinstance(new_scale, Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError(
                        "new_scale must be a float or a one-element tensor without grad"
                    )
                scale.copy_(new_scale.reshape(()))
            else:
                scale.fill_(float(new_scale))
        else:
            found = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
            if not found:
                raise RuntimeError(
                    "No inf checks were recorded prior to update(): call scaler.step(optimizer) "
                    "(or scaler.unscale_(optimizer)) after pipe.step, before update()"
                )
            combined = torch.stack(found).sum()
            torch._amp_update_scale_(
                scale,
                self._growth_tracker,
                combined,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
        self._per_optimizer = defaultdict(_OptimizerState)

    def get_scale(self) -> float:
        """The current scale (1.0 when not enabled)."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return self._init_scale
        return float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_factors(self.get_scale(), new_factor, self._backoff_factor, self._growth_interval)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_factors(self.get_scale(), self._growth_factor, new_factor, self._growth_interval)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_factors(self.get_scale(), self._growth_factor, self._backoff_factor, new_interval)
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``, as torch's (empty when not enabled); plain numbers."""
        if not self._enabled:
            return {}
        tracker = (
            self._init_growth_tracker
            if self._growth_tracker is None
            else int(self._growth_tracker.item())
        )
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (no-op when not enabled).

        Raises:
            RuntimeError: if ``state_dict`` is empty (saved from a disabled scaler).
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)

    # -- helpers ---------------------------------------------------------------------

    def _bound(self, method: str) -> _Binding:
        if self._binding is None:
            raise RuntimeError(
                f"GradScaler.{method}(): this scaler was not given to a pipeline; build it with "
                "Pipeline(..., grad_scaler=scaler), so that the pipeline scales the losses and "
                "the ranks agree on overflows (torch.amp.GradScaler is for one process)"
            )
        return self._binding

    def _scale_tensor(self) -> Tensor:
        """The scale as a float32 tensor, created on first use (on the pipeline's device)."""
        if self._scale is None:
            device = self._binding.device if self._binding is not None else torch.device("cpu")
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full(
                (), self._init_growth_tracker, dtype=torch.int32, device=device
            )
        return self._scale


def _check_factors(
    init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
) -> None:
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale={init_scale}: give a finite scale above 0")
    if not growth_factor >= 1.0:
        raise ValueError(f"growth_factor={growth_factor}: give 1.0 or more (2.0: doubling)")
    if not 0.0 < backoff_factor <= 1.0:
        raise ValueError(f"backoff_factor={backoff_factor}: give a factor in (0, 1] (0.5: halving)")
    if int(growth_interval) < 1:
        raise ValueError(f"growth_interval={growth_interval}: give 1 or more steps")
