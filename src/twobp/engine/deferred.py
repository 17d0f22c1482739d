"""The autograd Function that splits an operation's backward, and the base class of deferred ops.

While a micro-batch is active, an operation whose weight operand is a stage
parameter runs through :class:`DeferredWeightFunction`. The parameters are
inputs of the Function, so that its graph node exists even when the other
operand needs no gradient (the first layer of stage 0, an embedding), but the
Function returns no gradient for them: autograd accumulates nothing into their
``.grad``. Its backward computes only the input gradient and hands what the
weight gradient needs to the store, under the micro-batch id captured at
forward time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from twobp.engine.autocast import AutocastRule
from twobp.engine.operand import Operand
from twobp.engine.stash import SharedRows

# (micro-batch, op index, stashed tensors) -> None
StashSink = Callable[[int, int, tuple[Tensor, ...]], None]


def in_input_dtype(grad: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``grad`` in the dtype of the input it is the gradient of (None: as it is).

    Under ``torch.autocast`` the operation ran in another dtype than its input's.
    """
    return grad if dtype is None or grad.dtype == dtype else grad.to(dtype)


def held_or_shape(param: Tensor) -> Tensor:
    """``param``; or, where it holds no elements now (a weight sharded over copies and freed
    before its stage's weight pass, ``shard_parameters=True``), a tensor of its shape and
    dtype that holds one zero, for the weight passes whose kernels take the weight but whose
    weight gradient does not depend on its values (norms, convolutions)."""
    if param.numel() and param.untyped_storage().nbytes() == 0:
        return param.new_zeros(()).expand(param.shape)
    return param


class DeferredOp(ABC):
    """One use of stage parameters by one kind of operation: how it runs F, I and W.

    A deferred op is made the first time a forward calls the operation with
    these parameter operands and these options (``F.linear`` with ``fc.weight``
    and ``fc.bias``; ``F.conv2d`` with a given stride and padding) and serves
    every later call alike, in every micro-batch. Subclasses exist per
    operation family (linear, matmul, convolution, ...).

    Args:
        index: the op's position in its store (the key of its stashes).
        operands: the parameter operands, weight and bias (None where the call
            has none).
        options: the call's static options (a convolution's stride and
            padding), hashable; part of the op's identity.
        sink: where the input pass hands the stashed tensors.
    """

    autocast_rule: ClassVar[AutocastRule] = AutocastRule.LOWER
    """Which dtype the operation runs in under ``torch.autocast``."""

    def __init__(
        self,
        index: int,
        operands: tuple[Operand | None, Operand | None],
        options: Any,
        sink: StashSink,
    ) -> None:
        self.index = index
        self.operands = operands
        self.options = options
        self.sink = sink
        self.name = ""
        """Names the op in errors: the operation and its parameters (set by the capture)."""
        # What the Function's backward returns after the input gradient: no
        # gradient for the parameters (W adds it later). Built once: the
        # backward runs for every call.
        self.no_parameter_grads = (None, None)
        self.plain = all(o is None or not o.steps for o in operands)
        """Every operand is a parameter read as it is (no view or cast): the common, fast case."""

    def weight_grad_mask(self) -> list[bool]:
        """An aten backward's output mask for W: no input gradient; weight and bias if wanted."""
        weight, bias = self.operands
        return [
            False,
            weight is not None and weight.param.requires_grad,
            bias is not None and bias.param.requires_grad,
        ]

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype) -> Tensor:
        """A tiny call of the operation on ``dtype`` inputs (for :attr:`AutocastRule.PROBED`)."""
        raise NotImplementedError

    def weights(
        self, params: Sequence[Tensor | None], dtype: torch.dtype | None
    ) -> tuple[Tensor | None, ...]:
        """The tensors the operation reads: each parameter through its views, cast to ``dtype``.

        Args:
            params: the parameters passed to the Function, in operand order.
            dtype: the dtype autocast would cast the operands to, or None.
        """
        if self.plain and dtype is None:
            return tuple(params)
        return tuple(
            None if o is None or p is None else o.read(p, dtype)
            for o, p in zip(self.operands, params, strict=True)
        )

    def apply(self, mb: int, call: Any, x: Tensor, params: Sequence[Tensor | None]) -> Tensor:
        """Run the operation on ``x`` through :class:`DeferredWeightFunction`.

        Args:
            mb: the micro-batch.
            call: per-call state for :meth:`forward` (the autocast dtype, ...).
            x: the operand that is not a parameter (input, indices).
            params: the parameters, in operand order (None where absent).
        """
        out: Tensor = apply_function(self, mb, call, x, *params)
        return out

    @abstractmethod
    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        """The operation, run without autograd.

        Args:
            x: the operand that is not a parameter.
            params: the parameters, in operand order.
            call: what :meth:`apply` passed along.

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
            needs_input_grad: whether ``x`` requires a gradient.

        Returns:
            The gradient of ``x`` (None when not needed), in ``x``'s dtype,
            and the tensors to stash.
        """

    @abstractmethod
    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        """The weight pass over stashes of any number of calls and micro-batches.

        Computes the parameter gradients with as few operations as pay off (a
        matrix product concatenates stashes up to
        :data:`~twobp.engine.stash.CONCAT_ROWS` rows) and adds them into
        ``.grad`` of every parameter operand that requires a gradient.

        Args:
            stashes: what :meth:`input_grad` stashed, one tuple per call.
            shared: concatenations of inputs, shared with the previous op.
        """


class DeferredWeightFunction(torch.autograd.Function):
    """Forward of a deferred op whose backward computes only the input gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, op: DeferredOp, mb: int, call: Any, x: Tensor, *params: Tensor | None
    ) -> Tensor:
        out, saved, state = op.forward(x, params, call)
        ctx.op, ctx.mb, ctx.state = op, mb, state
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        op: DeferredOp = ctx.op
        if torch.is_grad_enabled():
            # A checked, cheaper stand-in for @once_differentiable.
            raise RuntimeError(
                f"{op.name}: double backward (create_graph=True) through an operation with a "
                f"deferred weight gradient is not supported"
            )
        # Unpacked first: under activation checkpointing this recomputes the
        # forward, which must go through the store's capture like the first
        # one. The input pass's own operations skip the capture.
        saved = ctx.saved_tensors
        with torch._C.DisableTorchFunction():
            grad_in, stash = op.input_grad(grad_out, saved, ctx.state, ctx.needs_input_grad[3])
            op.sink(ctx.mb, op.index, stash)
        return (None, None, None, grad_in, *op.no_parameter_grads)


def _direct_apply() -> Callable[..., Any] | None:
    """``DeferredWeightFunction``'s apply without the Python wrapper of ``Function.apply``.

    That wrapper costs ~20 us per call (a third of a deferred op's overhead
    in F); outside functorch transforms it only unwraps dead functorch
    wrappers and calls the C++ ``apply``. None where this torch has no such
    ``apply`` (the wrapper is used then).
    """
    descriptor = getattr(torch._C, "_FunctionBase", type).__dict__.get("apply")
    if descriptor is None or not hasattr(torch._C, "_are_functorch_transforms_active"):
        return None
    bound: Callable[..., Any] = descriptor.__get__(None, DeferredWeightFunction)
    return bound


DIRECT_APPLY = _direct_apply()


def apply_function(op: DeferredOp, mb: int, call: Any, x: Tensor, *params: Any) -> Any:
    """``DeferredWeightFunction.apply(op, mb, call, x, *params)``, directly where it can."""
    if DIRECT_APPLY is None or torch._C._are_functorch_transforms_active():
        return DeferredWeightFunction.apply(op, mb, call, x, *params)  # type: ignore[no-untyped-call]
    # What Function.apply does outside transforms: a dead functorch wrapper
    # (only the operand x can be one; parameters are plain) is unwrapped first.
    return DIRECT_APPLY(op, mb, call, torch._C._functorch.unwrap_if_dead(x), *params)
