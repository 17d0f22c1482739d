"""One stage of the pipeline: its blocks, and the tensors kept between F and B/I.

A stage runs every micro-batch in its own autograd graph: its inputs are
detached leaves (received buffers, or the previous local stage's outputs
detached), so the backward of a stage stops at its inputs and hands their
gradients to the previous stage, local or remote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from twobp.runtime.execution.backward import StageGradients
from twobp.runtime.execution.microbatch import Batch, flatten, unflatten

LossFn = Callable[[Any, Any], Tensor]
"""``loss_fn(output, target) -> scalar``, the mean over one micro-batch."""


@dataclass
class _Stash:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


class Stage:
    """The blocks of one stage and their per-micro-batch state within a step.

    Args:
        index: the stage index.
        n_stages: stages of the whole pipeline.
        module: the stage's blocks (an ``nn.Sequential`` named by global block index).
        gradients: the stage's backward machinery.
        loss_fn: the loss, used by the last stage.
        n_microbatches: micro-batches per step; each loss is scaled by its inverse.
        model_stage: which stage of the model it runs, when the schedule has
            several pipelines (``n_stages`` is then the stages of one); None: ``index``.
        autocast: ``(device type, dtype)`` to run the forward (and loss) under
            ``torch.autocast``, or None. The backward needs none: autograd and
            the 2BP engine run each operation's backward in its forward's dtypes.
    """

    def __init__(
        self,
        index: int,
        n_stages: int,
        module: nn.Module,
        gradients: StageGradients,
        loss_fn: LossFn,
        n_microbatches: int,
        autocast: tuple[str, torch.dtype] | None = None,
        model_stage: int | None = None,
    ) -> None:
        self.index = index
        self.module = module
        self.gradients = gradients
        position = index if model_stage is None else model_stage
        self.is_first = position == 0
        self.is_last = position == n_stages - 1
        self._loss_fn = loss_fn
        self._scale = 1.0 / n_microbatches
        self._stash: dict[int, _Stash] = {}
        self._autocast = autocast

    def forward(
        self, mb: int, inputs: Sequence[Tensor], is_tuple: bool, target: Batch | None
    ) -> tuple[tuple[Tensor, ...], bool]:
        """F of ``mb``; keeps what its backward needs when autograd is on.

        Args:
            mb: the micro-batch.
            inputs: the stage's input tensors (leaves; activations flagged
                ``requires_grad`` where the previous stage's outputs were).
            is_tuple: whether to pass them to the first block as a tuple.
            target: the micro-batch's targets (last stage only; None in
                evaluation without targets).

        Returns:
            The output tensors and whether they form a tuple; for the last
            stage with a target, the detached loss as a one-tensor output.
        """
        batch = unflatten(inputs, is_tuple)
        training = torch.is_grad_enabled()
        context = self.gradients.forward(mb) if training else torch.no_grad()
        cast = (
            contextlib.nullcontext() if self._autocast is None else torch.autocast(*self._autocast)
        )
        with context, cast:
            output = self.module(batch)
            if self.is_last and target is not None:
                output = self._loss_fn(output, target)
        tensors, out_is_tuple = flatten(output, f"the output of stage {self.index}")
        if self.is_last and target is not None and tensors[0].numel() != 1:
            raise ValueError(
                f"loss_fn returned a tensor of shape {list(tensors[0].shape)}; it must return "
                "a scalar, the mean loss over the micro-batch (use reduction='mean')"
            )
        if training:
            self._stash[mb] = _Stash(
                inputs=tuple(t for t in inputs if t.requires_grad),
                outputs=tuple(t for t in tensors if t.requires_grad),
            )
        if self.is_last and target is not None:
            return (tensors[0].detach(),), False
        return tensors, out_is_tuple

    def backward(self, mb: int, grad_outputs: Sequence[Tensor], split: bool) -> tuple[Tensor, ...]:
        """B (``split=False``) or I (``split=True``) of ``mb``.

        Args:
            mb: the micro-batch.
            grad_outputs: gradients of the outputs that require grad, in
                order; ignored by the last stage, which starts from its loss
                scaled by ``1 / n_microbatches``.
            split: run the input pass only, leaving the weights to :meth:`weight`.

        Returns:
            The gradients of the stage inputs that require grad (zeros for an
            unused input), in order: what the previous stage receives.

        Raises:
            KeyError: if the forward of ``mb`` did not run in this step.
        """
        stash = self._stash.pop(mb)
        if self.is_last:
            grad_outputs = [torch.full_like(t, self._scale) for t in stash.outputs]
        run = self.gradients.backward_input if split else self.gradients.backward_full
        grads = run(mb, stash.outputs, tuple(grad_outputs), stash.inputs)
        return tuple(
            torch.zeros_like(x) if g is None else g
            for x, g in zip(stash.inputs, grads, strict=True)
        )

    def weight(self, mbs: Sequence[int], group_size: int | None) -> None:
        """W of ``mbs``: accumulate their weight gradients."""
        self.gradients.backward_weight(mbs, group_size=group_size)

    def finish_step(self) -> None:
        """End the step: nothing may be left half done.

        Raises:
            RuntimeError: if a forward had no backward, or a W is missing.
        """
        if self._stash:
            left = sorted(self._stash)
            self._stash.clear()
            raise RuntimeError(
                f"stage {self.index} ended the step with micro-batches {left} run forward "
                "but never backward; the schedule lacks their B or I"
            )
        self.gradients.finish_step()

    def abandon_step(self) -> None:
        """Forget a step that failed part-way, so that the next one starts clean."""
        self._stash.clear()
        # The store complains about the unfinished work, and forgets it.
        with contextlib.suppress(RuntimeError):
            self.gradients.finish_step()
