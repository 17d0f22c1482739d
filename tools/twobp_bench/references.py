"""Single-process references: what one process needs for the same step.

A pipeline of ``p`` ranks at best runs ``p`` times faster than one process
doing the same work, so each reference time divided by ``p`` is a bound the
pipeline is measured against (its *efficiency* is that bound over its step
time). Three references, each on the whole model in one process:

``microbatched`` (a)
    F and B of each of the ``m`` micro-batches in turn (gradient accumulation):
    the same work as the pipeline, with no bubble and no communication.
``whole-batch`` (b)
    F and B of the whole batch at once: the practical limit, since larger
    GEMMs run faster per row than the micro-batches' small ones.
``2bp-limit`` (c)
    F and I per micro-batch under the 2BP engine, then one W concatenated
    over all of them: what 2BP can reach, F and I at micro-batch cost and W
    at whole-batch cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from twobp.engine import defer_weight_grads
from twobp.runtime.execution.microbatch import Batch, split_batch
from twobp.runtime.execution.stage import LossFn
from twobp_bench.matrix import REFERENCE_MICROBATCHED, REFERENCE_TWO_BP_LIMIT, REFERENCES


class ReferenceRunner:
    """One of the references on this rank, alone (no communication).

    Args:
        name: one of :data:`~twobp_bench.matrix.REFERENCES`.
        blocks: a fresh copy of the whole model's blocks.
        loss_fn: the model's loss (a mean over a micro-batch).
        n_microbatches: micro-batches of the micro-batched references.
        inputs: the whole batch of model inputs.
        targets: the whole batch of targets.
        device: where to run.

    Raises:
        ValueError: on an unknown reference name.
    """

    collective = False

    def __init__(
        self,
        name: str,
        blocks: Sequence[nn.Module],
        loss_fn: LossFn,
        n_microbatches: int,
        inputs: Batch,
        targets: Batch,
        *,
        device: torch.device,
    ) -> None:
        if name not in REFERENCES:
            raise ValueError(f"unknown reference {name!r}; choose from {', '.join(REFERENCES)}")
        self.name = name
        self.model = nn.Sequential(*blocks).to(device)
        self._loss_fn = loss_fn
        self._scale = 1.0 / n_microbatches
        self._inputs = inputs
        self._targets = targets
        self._mb_inputs = split_batch(inputs, n_microbatches, "inputs")
        self._mb_targets = split_batch(targets, n_microbatches, "targets")
        self._store = (
            defer_weight_grads(self.model, label="reference")
            if name == REFERENCE_TWO_BP_LIMIT
            else None
        )

    def step(self) -> None:
        if self.name == REFERENCE_MICROBATCHED:
            for x, y in zip(self._mb_inputs, self._mb_targets, strict=True):
                torch.autograd.backward([self._loss_fn(self.model(x), y) * self._scale])
        elif self._store is not None:
            store = self._store
            for mb, (x, y) in enumerate(zip(self._mb_inputs, self._mb_targets, strict=True)):
                with store.forward(mb):
                    loss = self._loss_fn(self.model(x), y) * self._scale
                store.backward_input(mb, [loss], [None], [])
            store.backward_weight(range(len(self._mb_inputs)))
            store.finish_step()
        else:
            torch.autograd.backward([self._loss_fn(self.model(self._inputs), self._targets)])

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def after_step(self) -> dict[str, float]:
        return {}
