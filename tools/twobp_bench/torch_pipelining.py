"""A ``torch.distributed.pipelining`` schedule as a bench variant: the baseline.

Each rank builds its stage modules by hand from the same blocks and the same
partition as twobp (an ``nn.Sequential`` of the stage's blocks), wraps them in
``PipelineStage`` and runs the schedule class. Work is made equal to twobp's:

* torch calls ``loss_fn`` per micro-batch and, with ``scale_grads=True``,
  divides every gradient by ``m`` after the step (one extra pass over the
  parameters). twobp seeds each micro-batch's backward with ``1 / m``
  instead. Here the loss is scaled by ``1 / m`` and ``scale_grads=False``,
  which gives the same gradients as twobp without the extra pass;
* ``return_outputs=False``: twobp does not gather the last stage's outputs either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.pipelining as pipelining
from torch import Tensor, nn

from twobp.partition import stage_ranges
from twobp.runtime.execution.microbatch import Batch, flatten
from twobp.runtime.execution.stage import LossFn
from twobp.runtime.setup.replicas import shared_parameters
from twobp_bench.matrix import TORCH_SCHEDULES, Variant, placement, stages_of_rank


def tie_refusal(
    blocks: Sequence[nn.Module],
    partition: Sequence[int],
    stage_ranks: Sequence[int],
    framework: str = "torch.distributed.pipelining",
) -> str | None:
    """Why torch cannot run this layout: a weight that stages on several ranks share.

    A model that ties its output head to its embedding uses one parameter in
    the first and the last stage. ``torch.distributed.pipelining`` gives each
    rank's stages their own copy and never sums the copies' gradients, so the
    step would differ from the model's. Stages on one rank hold one object,
    whose gradient collects both uses. DeepSpeed's ``PipelineEngine`` sums a
    tied weight's gradients only where the model declares it with its own
    ``TiedLayerSpec``, which plain blocks do not.

    Args:
        blocks: the whole model's blocks.
        partition: blocks per stage.
        stage_ranks: the rank of each stage.
        framework: the name the reason gives the runtime that cannot run it.

    Returns:
        The reason to skip the variant, or None if it can run.
    """
    for tie in shared_parameters(blocks, stage_ranges(list(partition))).values():
        ranks = sorted({stage_ranks[s] for s in tie.model_stages})
        if len(ranks) > 1:
            return (
                f"{' and '.join(tie.names)} are one tied weight on ranks "
                f"{', '.join(map(str, ranks))}; {framework} keeps a copy per "
                "rank and does not sum their gradients"
            )
    return None


class StageModule(nn.Module):
    """The blocks of one stage; takes what the previous stage sent as positional arguments.

    torch calls a stage with the previous stage's outputs unpacked (``f(*outputs)``),
    whereas the blocks take one tensor or one tuple.
    """

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, *args: Tensor) -> Any:
        return self.blocks(args[0] if len(args) == 1 else tuple(args))


class ScaledLoss:
    """``loss_fn(output, target) / m``: the micro-batch's share of the mean loss."""

    def __init__(self, loss_fn: LossFn, n_microbatches: int) -> None:
        self._loss_fn = loss_fn
        self._scale = 1.0 / n_microbatches

    def __call__(self, output: Any, target: Any) -> Tensor:
        loss: Tensor = self._loss_fn(output, target)
        return loss * self._scale


class TorchRunner:
    """A ``torch.distributed.pipelining`` schedule over this rank's stages.

    Args:
        variant: a torch variant (its schedule names a :data:`TORCH_SCHEDULES` entry).
        blocks: a fresh copy of the whole model's blocks.
        loss_fn: the model's loss (a mean over a micro-batch).
        n_microbatches: micro-batches per step.
        partition: blocks per stage (``p * stages_per_rank`` stages).
        inputs: the whole batch of model inputs.
        targets: the whole batch of targets.
        rank: this rank.
        n_ranks: ranks in the group.
        device: this rank's device.

    Raises:
        ValueError: if torch refuses the combination (its own message).
    """

    collective = True

    def __init__(
        self,
        variant: Variant,
        blocks: Sequence[nn.Module],
        loss_fn: LossFn,
        n_microbatches: int,
        partition: Sequence[int],
        inputs: Batch,
        targets: Batch,
        *,
        rank: int,
        n_ranks: int,
        device: torch.device,
    ) -> None:
        info = TORCH_SCHEDULES[variant.schedule]
        self.n_microbatches = n_microbatches
        """The micro-batches the schedule cuts the batch into."""
        stage_ranks = placement(variant, n_ranks)
        n_stages = len(stage_ranks)
        if len(partition) != n_stages:
            raise ValueError(
                f"{info.class_name} has {n_stages} stages but the partition has {len(partition)}"
            )
        ranges = stage_ranges(list(partition))
        mine = stages_of_rank(stage_ranks, rank)
        self.modules = [StageModule([blocks[i] for i in ranges[s]]).to(device) for s in mine]
        self._block_indices = [list(ranges[s]) for s in mine]
        stages = [
            pipelining.PipelineStage(module, s, n_stages, device)
            for s, module in zip(mine, self.modules, strict=True)
        ]
        schedule_class = getattr(pipelining, info.class_name)
        self._schedule = schedule_class(
            stages[0] if info.stages_per_rank == 1 else stages,
            n_microbatches,
            loss_fn=ScaledLoss(loss_fn, n_microbatches),
            scale_grads=False,
        )
        self._args = flatten(inputs)[0] if 0 in mine else ()
        self._target = targets if n_stages - 1 in mine else None

    def step(self) -> None:
        self._schedule.step(*self._args, target=self._target, return_outputs=False)

    def zero_grad(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules for p in module.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Named by block index in the whole model, as twobp's pipeline names them: a weight
        tied between this rank's stages once, under its first name."""
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for module, indices in zip(self.modules, self._block_indices, strict=True):
            for name, p in module.blocks.named_parameters():
                local, _, rest = name.partition(".")
                named.setdefault(id(p), (f"{indices[int(local)]}.{rest}", p))
        return list(named.values())

    def after_step(self) -> dict[str, float]:
        return {}
