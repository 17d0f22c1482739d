"""One stage of the pipeline: its blocks, and the tensors kept between F, I (or B) and W.

A stage runs every micro-batch in its own autograd graph: its inputs are
detached leaves (received buffers, or the previous local stage's outputs
detached), so the backward of a stage stops at its inputs and hands their
gradients to the previous stage, local or remote.

With recomputation (:mod:`twobp.sim.recompute`) a stage keeps less: under
``"activations"`` its forward runs without autograd and again at the start of
``I`` (or ``B``); under ``"derivatives"`` its ``I`` keeps no stash, only the
inputs and output gradients, and its ``W`` runs the forward and input pass
again to rebuild it. Both replay the random number states of the first
forward (:mod:`twobp.runtime.execution.recompute`). Without a mode, the
schedule may rebuild the stash of some micro-batches only (``recompute="auto"``):
their ``IR`` keeps what ``"derivatives"`` keeps, their ``WR`` rebuilds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from twobp.runtime.execution.backward import StageGradients
from twobp.runtime.execution.memory import (
    ACTIVATIONS,
    STASH,
    MemoryMeter,
    Signature,
    forward_signature,
    storages,
)
from twobp.runtime.execution.microbatch import Batch, flatten, unflatten
from twobp.runtime.execution.recompute import BufferCheck, RngState
from twobp.sim.recompute import Mode, recomputes_activations, recomputes_derivatives

LossFn = Callable[[Any, Any], Any]
"""``loss_fn(output, target)``: a scalar, the mean over one micro-batch; or a pair of
scalars ``(sum, count)``, the sum of the losses of the micro-batch's items and how many
items it counts (tokens that are not padding): the step's loss is then the sum over the
whole batch divided by the count over the whole batch."""


@dataclass
class _Kept:
    """What a stage keeps of one micro-batch between its passes."""

    inputs: tuple[Tensor, ...]
    """Every input tensor of the stage (leaves)."""
    is_tuple: bool
    target: Batch | None
    rng: RngState | None
    """The generator states of the first forward (None without recomputation)."""
    flags: tuple[bool, ...]
    """Which outputs were sent as needing a gradient: those a recomputation returns."""
    weight: float = 1.0
    """What the last stage's backward starts from: the weight of the micro-batch's loss."""
    outputs: tuple[Tensor, ...] = ()
    """The outputs that require grad, until I; none when I recomputes them."""
    grad_outputs: tuple[Tensor, ...] = ()
    """Their gradients, from I until W (derivative checkpointing)."""
    sources: tuple[Tensor, ...] = ()
    """The views of a batch that requires grad which ``inputs`` stand for as leaves (a
    first stage's); empty when the inputs are the stage's own leaves."""

    @property
    def grad_inputs(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.inputs if t.requires_grad)


class Stage:
    """The blocks of one stage and their per-micro-batch state within a step.

    Args:
        index: the stage index.
        n_stages: stages of the whole pipeline.
        module: the stage's blocks (an ``nn.Sequential`` named by global block index).
        gradients: the stage's backward machinery.
        loss_fn: the loss, used by the last stage.
        n_microbatches: micro-batches per step; each loss is scaled by its inverse
            unless :meth:`forward` is given the micro-batch's weight.
        model_stage: which stage of the model it runs, when the schedule has
            several pipelines (``n_stages`` is then the stages of one); None: ``index``.
        autocast: ``(device type, dtype)`` to run the forward (and loss) under
            ``torch.autocast``, or None. The backward needs none: autograd and
            the 2BP engine run each operation's backward in its forward's dtypes.
        recompute: the stage's recompute mode (None, ``"activations"``,
            ``"derivatives"``, ``"all"``); ``"derivatives"`` only on a stage
            that runs ``I`` and ``W``.
        memory: the rank's meter of what its stages hold; None: a meter of its own.
        label: names the stage in errors (``"rank 1 stage 3"``); None: ``"stage 3"``.
        rebuilt: the micro-batches whose stash the schedule rebuilds (their
            ``IR`` and ``WR``): their forward keeps its random states.
        model_name: an entry's name (``3.bn.running_mean``) in the model the blocks
            were cut from, for errors (see :class:`~twobp.runtime.execution.recompute.BufferCheck`).
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
        recompute: Mode = None,
        memory: MemoryMeter | None = None,
        label: str | None = None,
        rebuilt: Collection[int] = (),
        model_name: Callable[[str], str | None] | None = None,
    ) -> None:
        self.index = index
        self.model_name = model_name
        """An entry's name in the model the blocks were cut from (errors name it so)."""
        self._rebuilt = frozenset(rebuilt)
        self.module = module
        # Its parameters, walked once: read at every forward (as the engine's store
        # and the stage's gradients keep them, the stage's parameters stay these).
        self._parameters = tuple(module.parameters())
        self.gradients = gradients
        position = index if model_stage is None else model_stage
        self.is_first = position == 0
        self.is_last = position == n_stages - 1
        self.recompute = recompute
        self.memory = memory if memory is not None else MemoryMeter(torch.device("cpu"))
        self._loss_fn = loss_fn
        self._n_microbatches = n_microbatches
        self._scale = 1.0 / n_microbatches
        self._loss_scale = 1.0
        self._kept: dict[int, _Kept] = {}
        self._pending: dict[int, _Kept] = {}
        self._autocast = autocast
        self._label = label or f"stage {index}"

    def set_loss_scale(self, scale: float) -> None:
        """Start the backward of every later micro-batch's loss from ``scale / n_microbatches``
        (a loss scale for float16: :class:`twobp.runtime.state.grad_scaler.GradScaler`)."""
        self._scale = scale / self._n_microbatches
        self._loss_scale = scale

    def _cast(self) -> contextlib.AbstractContextManager[Any]:
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(*self._autocast)

    def _run(self, inputs: Sequence[Tensor], is_tuple: bool, target: Batch | None) -> Any:
        output = self.module(unflatten(inputs, is_tuple))
        if self.is_last and target is not None:
            output = self._loss_fn(output, target)
            if isinstance(output, (tuple, list)) and len(output) == 2:
                # (sum, count): the count takes no part in the backward.
                output = (output[0], torch.as_tensor(output[1]).detach())
        return output

    def forward(
        self,
        mb: int,
        inputs: Sequence[Tensor],
        is_tuple: bool,
        target: Batch | None,
        weight: float | None = None,
    ) -> tuple[tuple[Tensor, ...], bool]:
        """F of ``mb``; keeps what its backward needs when autograd is on.

        Args:
            mb: the micro-batch.
            inputs: the stage's input tensors (leaves; activations flagged
                ``requires_grad`` where the previous stage's outputs were).
            is_tuple: whether to pass them to the first block as a tuple.
            target: the micro-batch's targets (last stage only; None in
                evaluation without targets).
            weight: the weight of the micro-batch's mean loss in the step's
                (last stage only; None: ``1 / n_microbatches``). A loss
                returning ``(sum, count)`` is not weighted: the step divides
                its gradients by the count of the whole batch at its end.

        Returns:
            The output tensors and whether they form a tuple; for the last
            stage with a target, the detached loss as a one-tensor output,
            or the detached sum and count as two.

        Raises:
            ValueError: if the loss is neither a scalar nor a pair of scalars.
        """
        inputs = tuple(inputs)
        training = torch.is_grad_enabled()
        sources: tuple[Tensor, ...] = ()
        if training and any(x.requires_grad and not x.is_leaf for x in inputs):
            # Views of a batch that requires grad (a first stage's): the stage runs on
            # leaves of its own, and its backward hands their gradients on to the batch.
            sources = inputs
            inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
        rng = None
        if training and (self.recompute is not None or mb in self._rebuilt) and inputs:
            rng = RngState.capture(inputs[0].device)
        saved: dict[Any, int] = {}
        beyond: int | None = None
        signature: Signature = ()
        if training:
            targets = flatten(target, "the targets")[0] if target is not None else ()
            signature = forward_signature((*inputs, *targets), self._parameters, self.recompute)
            beyond = self.memory.saved_beyond(self.index, signature)
        if not training or recomputes_activations(self.recompute):
            context: contextlib.AbstractContextManager[Any] = torch.no_grad()
        else:
            context = contextlib.ExitStack()
            context.enter_context(self.gradients.forward(mb))
            if beyond is None:
                context.enter_context(self.memory.saved(saved))
        with context, self._cast():
            output = self._run(inputs, is_tuple, target)
        tensors, out_is_tuple = flatten(output, f"the output of stage {self.index}")
        seed = self._scale if weight is None else weight * self._loss_scale
        if self.is_last and target is not None:
            check_loss(tensors, out_is_tuple)
            if out_is_tuple:
                seed = self._loss_scale
        if training:
            tensors = self._keep(
                mb,
                _Kept(inputs, is_tuple, target, rng, (), weight=seed, sources=sources),
                tensors,
                targets,
                (signature, saved, beyond),
            )
        if self.is_last and target is not None:
            return tuple(t.detach() for t in tensors), False
        return tensors, out_is_tuple

    def _keep(
        self,
        mb: int,
        kept: _Kept,
        tensors: tuple[Tensor, ...],
        targets: Sequence[Tensor],
        watched: tuple[Signature, dict[Any, int], int | None],
    ) -> tuple[Tensor, ...]:
        """Keep what the backward of ``mb`` needs (``kept``, with the outputs), and count
        what it holds; the outputs as the next stage gets them."""
        signature, saved, beyond = watched
        inputs = kept.inputs
        if recomputes_activations(self.recompute):
            # Flagged as the forward with autograd would have (the next stage
            # sends gradients for them); I keeps those its recomputation flags.
            wanted = any(x.requires_grad for x in inputs) or any(
                p.requires_grad for p in self._parameters
            )
            tensors = tuple(
                t.detach().requires_grad_() if wanted and t.is_floating_point() else t
                for t in tensors
            )
        kept.flags = tuple(t.requires_grad for t in tensors)
        if not recomputes_activations(self.recompute):
            kept.outputs = tuple(t for t in tensors if t.requires_grad)
        self._kept[mb] = kept
        # The target too: the stage keeps it until the backward.
        held = storages((*inputs, *kept.outputs, *targets))
        if beyond is None:
            self.memory.learn_saved(self.index, signature, saved, held)
            held = {**saved, **held}
        else:
            # Same shapes as the watched forward: as many bytes saved.
            held[("saved", id(kept))] = beyond
        self.memory.hold(ACTIVATIONS, (self.index, mb), held)
        self.memory.sample()
        return tensors

    def _forward_again(self, mb: int, kept: _Kept, saved: dict[Any, int]) -> tuple[Tensor, ...]:
        """The forward of ``mb`` run again from its inputs and random states: its outputs."""
        check = BufferCheck(self.module, self.model_name)
        rng = kept.rng.replay() if kept.rng is not None else contextlib.nullcontext()
        with rng, self._cast(), self.memory.saved(saved):
            output = self._run(kept.inputs, kept.is_tuple, kept.target)
        check.verify(f"{self._where()}micro-batch {mb}", str(self.recompute or "derivatives"))
        tensors, _ = flatten(output, f"the output of stage {self.index}")
        return tuple(t for t, flag in zip(tensors, kept.flags, strict=True) if flag)

    def _where(self) -> str:
        return f"{self._label}, "

    def backward(
        self, mb: int, grad_outputs: Sequence[Tensor], split: bool, keep_stash: bool = True
    ) -> tuple[Tensor, ...]:
        """B (``split=False``) or I (``split=True``) of ``mb``.

        Args:
            mb: the micro-batch.
            grad_outputs: gradients of the outputs that require grad, in
                order; ignored by the last stage, which starts from its loss
                scaled by the micro-batch's weight (see :meth:`forward`), times
                the loss scale (see :meth:`set_loss_scale`).
            split: run the input pass only, leaving the weights to :meth:`weight`.
            keep_stash: with ``split``, False keeps only the inputs and output
                gradients for a :meth:`weight` with ``rebuild`` (an ``IR``).

        Returns:
            The gradients of the stage inputs that require grad (zeros for an
            unused input), in order: what the previous stage receives.

        Raises:
            KeyError: if the forward of ``mb`` did not run in this step.
            NonRepeatableForwardError: if a recomputed forward changed a buffer.
        """
        kept = self._kept.pop(mb)
        outputs = kept.outputs
        if recomputes_activations(self.recompute):
            saved: dict[Any, int] = {}
            with self.gradients.forward(mb):
                outputs = self._forward_again(mb, kept, saved)
            self.memory.sample(saved)
        if self.is_last:
            grad_outputs = [torch.full_like(t, kept.weight) for t in outputs]
        # A recomputed output sent as needing a gradient may not depend on anything
        # that needs one: it takes no part in the backward.
        used = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
        outputs = tuple(o for o, _ in used)
        grad_outputs = [g for _, g in used]
        inputs = kept.grad_inputs
        derivatives = split and (recomputes_derivatives(self.recompute) or not keep_stash)
        if split:
            grads = self.gradients.backward_input(
                mb, outputs, tuple(grad_outputs), inputs, keep_stash=not derivatives
            )
        else:
            grads = self.gradients.backward_full(mb, outputs, tuple(grad_outputs), inputs)
        del outputs
        self.memory.release(ACTIVATIONS, (self.index, mb))
        if derivatives:
            pending = replace(kept, outputs=(), grad_outputs=tuple(grad_outputs))
            self._pending[mb] = pending
            held = storages((*pending.inputs, *pending.grad_outputs))
            self.memory.hold(STASH, (self.index, mb), held)
        elif split:
            held = storages(self.gradients.stashed_tensors(mb))
            self.memory.hold(STASH, (self.index, mb), held)
        self.memory.sample()
        if kept.sources:
            _hand_on(kept, inputs, grads)
        return tuple(
            torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)
        )

    def _rebuild(self, mb: int) -> tuple[Sequence[Tensor], Sequence[Tensor | None]]:
        """The forward of ``mb`` again, for the engine to rebuild the stash of its W."""
        kept = self._pending[mb]
        saved: dict[Any, int] = {}
        outputs = [o for o in self._forward_again(mb, kept, saved) if o.requires_grad]
        # The stashes this W rebuilt so far are held too, until its group is done.
        rebuilt = storages(t for m in self._pending for t in self.gradients.stashed_tensors(m))
        self.memory.sample({**saved, **rebuilt})
        return outputs, kept.grad_outputs

    def weight(
        self, mbs: Sequence[int], weight_group_size: int | None, rebuild: bool = False
    ) -> None:
        """W of ``mbs``: accumulate their weight gradients, concatenating at most
        ``weight_group_size`` micro-batches at once (None: all); ``rebuild`` (a ``WR``,
        or every ``W`` under ``"derivatives"``) first rebuilds the stashes an ``IR`` dropped."""
        again = rebuild or recomputes_derivatives(self.recompute)
        self.gradients.backward_weight(
            mbs, weight_group_size=weight_group_size, rebuild=self._rebuild if again else None
        )
        for mb in mbs:
            self._pending.pop(mb, None)
            self.memory.release(STASH, (self.index, mb))

    def weight_in_parts(self, mbs: Sequence[int], weight_group_size: int | None) -> Iterator[None]:
        """W of ``mbs`` as :meth:`weight` runs it, one layer's weight gradients per ``next()``
        (see :meth:`twobp.engine.WeightGradStore.backward_weight_in_parts`); their stashes
        are released once it is exhausted. Not for a stage whose W rebuilds stashes."""
        parts = self.gradients.backward_weight_in_parts(mbs, weight_group_size)
        return self._released(parts, mbs)

    def _released(self, parts: Iterator[None], mbs: Sequence[int]) -> Iterator[None]:
        yield from parts
        for mb in mbs:
            self._pending.pop(mb, None)
            self.memory.release(STASH, (self.index, mb))

    def finish_step(self) -> None:
        """End the step: nothing may be left half done.

        Raises:
            RuntimeError: if a forward had no backward, or a W is missing.
        """
        self._pending.clear()
        if self._kept:
            left = sorted(self._kept)
            self._kept.clear()
            raise RuntimeError(
                f"stage {self.index} ended the step with micro-batches {left} run forward "
                "but never backward; the schedule lacks their B or I"
            )
        self.gradients.finish_step()

    def abandon_step(self) -> None:
        """Forget a step that failed part-way, so that the next one starts clean."""
        self._kept.clear()
        self._pending.clear()
        # The store complains about the unfinished work, and forgets it.
        with contextlib.suppress(RuntimeError):
            self.gradients.finish_step()


def check_loss(tensors: Sequence[Tensor], is_pair: bool) -> None:
    """Refuse a loss that is neither a scalar mean nor a pair of scalars ``(sum, count)``.

    Raises:
        ValueError: saying what the loss returned and what it must return.
    """
    if (len(tensors) == 2 if is_pair else len(tensors) == 1) and all(
        t.numel() == 1 for t in tensors
    ):
        return
    got = ", ".join(str(list(t.shape)) for t in tensors)
    raise ValueError(
        f"loss_fn returned {'a tuple of ' if is_pair else ''}tensors of shapes {got}; it "
        "must return a scalar, the mean loss over the micro-batch (use reduction='mean'), "
        "or a pair (sum, count) of scalars for an exact mean over the whole batch"
    )


def _hand_on(kept: _Kept, inputs: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Pass the gradients of a first stage's own leaves on to the views of the batch they
    stand for, so that the batch's ``.grad`` accumulates them as in plain PyTorch."""
    source = {id(leaf): view for leaf, view in zip(kept.inputs, kept.sources, strict=True)}
    pairs = [
        (source[id(x)], g)
        for x, g in zip(inputs, grads, strict=True)
        if g is not None and source[id(x)].requires_grad and source[id(x)] is not x
    ]
    if pairs:
        torch.autograd.backward([v for v, _ in pairs], [g for _, g in pairs])
