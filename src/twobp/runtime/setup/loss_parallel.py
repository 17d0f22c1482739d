"""The loss of a pipeline whose head leaves its logits split by vocabulary.

A ``"colwise_loss_parallel"`` head (:mod:`twobp.models.vocab_parallel`) hands the loss
``V / T`` columns of the logits on each tensor-parallel rank. The user's ``loss_fn`` runs
as written, inside :func:`twobp.models.vocab_parallel.loss_parallel`: its
``F.cross_entropy`` computes the vocabulary-parallel cross-entropy on the shards, any other
use of them is refused, and so is a loss that computed no cross-entropy of them (it would
have read a part of the vocabulary as the whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from twobp.models.tensor_parallel import LOSS_PARALLEL
from twobp.models.vocab_parallel import loss_parallel
from twobp.runtime.base.tensor_split import SPLIT_STYLE
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.stage import LossFn


class VocabParallelLoss:
    """``loss_fn`` run on logits split by vocabulary.

    Args:
        loss_fn: the user's loss, written for whole logits with ``F.cross_entropy``.
    """

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, target: Any) -> Any:
        with loss_parallel() as mode:
            loss = self.loss_fn(output, target)
        if mode.calls == 0:
            raise ValueError(
                "the head's logits are split by vocabulary ('colwise_loss_parallel') and the "
                "loss computed no F.cross_entropy of them; only a cross-entropy runs on the "
                "shards: gather the logits ('colwise_gather_output') for another loss"
            )
        return loss


def parallel_loss(blocks: Sequence[nn.Module], loss_fn: LossFn) -> LossFn:
    """``loss_fn``, run on the shards (:class:`VocabParallelLoss`) where the last block has a
    ``"colwise_loss_parallel"`` head.

    Raises:
        PipelineConfigError: a ``"colwise_loss_parallel"`` module in a block other than the
            last (the logits it leaves split would reach another block, not the loss).
    """
    split = [
        (index, name)
        for index, block in enumerate(blocks)
        for name, module in block.named_modules()
        if getattr(module, SPLIT_STYLE, None) == LOSS_PARALLEL
    ]
    early = [f"block {index}'s {name}" for index, name in split if index != len(blocks) - 1]
    if early:
        raise PipelineConfigError(
            "tensor_parallel_plan: 'colwise_loss_parallel' leaves a module's output split for "
            f"the loss, so only the last block's head may have it, not {', '.join(early)}: "
            "plan those 'colwise' or 'colwise_gather_output'"
        )
    return VocabParallelLoss(loss_fn) if split else loss_fn
