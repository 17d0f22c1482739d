"""What a reference model hands to a pipeline: its blocks and how to feed and score them.

A model is an ordered list of blocks; ``nn.Sequential(*spec.blocks)`` is the
whole model, and a pipeline cuts the list into contiguous stages. Each block
takes what the previous block returned (a tensor or a tuple of tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(output_of_last_block, target) -> scalar loss`` (a mean over the batch)."""

BatchFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``make_batch(batch_size, seed) -> (input, target)``."""


class BlockKind(str, Enum):
    """The role of a block in its model."""

    EMBEDDING = "embedding"
    """The first block: token embedding, or the stem of an image model."""
    BODY = "body"
    """A repeated block (decoder, encoder, state-space or bottleneck block)."""
    HEAD = "head"
    """The last block: final norm / pooling and the output projection."""


def stacked_kinds(n_body: int) -> list[BlockKind]:
    """The roles of a model built as first block, ``n_body`` body blocks, last block."""
    return [BlockKind.EMBEDDING, *[BlockKind.BODY] * n_body, BlockKind.HEAD]


@dataclass
class ModelSpec:
    """A reference model cut into pipeline blocks, with data and a loss to drive it.

    Args:
        family: the model family (``"llama"``, ``"bert"``, ``"mamba"``, ``"resnet"``).
        size: the preset name it was built from (``"tiny"``, ``"7b"``, ...).
        config: the family's config dataclass the blocks were built from.
        blocks: the model's blocks in order; ``nn.Sequential(*blocks)`` is the model.
        block_kinds: the role of each block, same length as ``blocks``.
        loss_fn: ``loss_fn(logits, target)``, a mean over the batch.
        make_batch: ``make_batch(batch_size, seed) -> (input, target)``, synthetic
            but well-formed data on the model's device.
        head_tied_in_reference: True where the model ties the output
            projection to the word embedding, as published (BERT, Mamba): the
            first and the last block share that parameter, and a pipeline keeps
            the two uses in step across ranks (see :meth:`num_parameters`).
        meta: extra facts (``vocab_size``, ``seq_len``, ``num_classes``, ...).
    """

    family: str
    size: str
    config: Any
    blocks: list[nn.Module]
    block_kinds: list[BlockKind]
    loss_fn: LossFn
    make_batch: BatchFn
    head_tied_in_reference: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.blocks) != len(self.block_kinds):
            raise ValueError(
                f"{self.family}-{self.size}: {len(self.blocks)} blocks but "
                f"{len(self.block_kinds)} block kinds"
            )

    @property
    def n_blocks(self) -> int:
        """Number of blocks."""
        return len(self.blocks)

    def example_input(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        """The input of the first block for a batch of ``batch_size`` samples.

        The same ``seed`` gives the input matching :meth:`example_target`.
        """
        return self.make_batch(batch_size, seed)[0]

    def example_target(self, batch_size: int, seed: int = 0) -> torch.Tensor:
        """The target that :attr:`loss_fn` compares the last block's output with."""
        return self.make_batch(batch_size, seed)[1]

    def sequential(self) -> nn.Sequential:
        """The whole model as one module (shares the blocks' parameters)."""
        return nn.Sequential(*self.blocks)

    def num_parameters(self, *, tied_once: bool = False) -> int:
        """Number of parameter elements over all blocks.

        Args:
            tied_once: count the tied output projection's weight once, with the
                word embedding, as the model holds it and the published sizes
                count it; False counts it as the untied model's separate weight
                (no effect where ``head_tied_in_reference`` is False).

        Returns:
            The parameter count.
        """
        unique = {id(p): p for block in self.blocks for p in block.parameters()}
        total = sum(p.numel() for p in unique.values())
        if not tied_once and self.head_tied_in_reference:
            total += self.meta["tied_head_numel"]
        return total
