"""The names a pipeline gives its entries: the blocks' own, or those of the model they came from.

A pipeline names its parameters and buffers as in ``nn.Sequential(*blocks)``
(``3.attn.q.weight``). Blocks cut by :func:`twobp.split` carry the names the
cut model gives each entry (``model_names``); the pipeline then speaks in
those names instead: ``state_dict()``, ``named_parameters()``, the checkpoint
files and ``merge`` (``layers.2.attn.q.weight``), so that the cut model loads
what a pipeline saved.

Each tensor is saved once, under its first name in ``model.state_dict()``; its
other names (a head tied to the token embedding: ``head.weight``, the same
tensor as ``tok.weight``) are *aliases* that the checkpoint's manifest lists,
so that ``merge`` gives every name the model has.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def model_names_of(blocks: object) -> dict[str, tuple[str, ...]] | None:
    """The model names ``blocks`` carry (``ModelBlocks.model_names``), or None."""
    names = getattr(blocks, "model_names", None)
    if names is None:
        return None
    return {str(k): tuple(v) for k, v in dict(names).items()}


class ModelNames:
    """Block names (``3.layers.2.q.weight``) to and from the names of the cut model.

    Args:
        names: for every entry of ``nn.Sequential(*blocks).state_dict()``, its
            names in the model's ``state_dict()`` in the model's order (none
            for an entry the model does not save).
    """

    def __init__(self, names: Mapping[str, Sequence[str]]) -> None:
        self._first = {block: n[0] for block, n in names.items() if len(n)}
        self.writer: dict[str, int] = {}
        """For every saved name, the first block that holds its tensor (whose writer saves it)."""
        for block, name in self._first.items():
            index = int(block.split(".", 1)[0])
            self.writer[name] = min(index, self.writer.get(name, index))
        self.aliases: dict[str, str] = {alias: n[0] for n in names.values() for alias in n[1:]}
        """Every other name of a tensor, to the name it is saved under."""

    def name(self, block_name: str) -> str | None:
        """The name entry ``block_name`` is saved under; None if the model does not save it."""
        return self._first.get(block_name)

    def state_dict(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """A state dict with block names in model names (each tensor once)."""
        out: dict[str, Any] = {}
        for block_name, value in local.items():
            name = self._first.get(block_name)
            if name is not None:
                out.setdefault(name, value)
        return out

    def named(self, named: Iterable[tuple[str, T]]) -> list[tuple[str, T]]:
        """``named_parameters()`` or ``named_buffers()`` in model names."""
        return [(self._first.get(n, n), p) for n, p in named]

    def to_blocks(
        self, state: Mapping[str, Any], local_names: Collection[str]
    ) -> tuple[dict[str, Any], list[str], list[str]]:
        """A state dict in model names (aliases taken too) as this rank's block names.

        Args:
            state: model names to values (of the whole model, or this rank's part).
            local_names: the block names of this rank's entries.

        Returns:
            The values by block name, the model names of this rank's entries that
            ``state`` lacks, and the names in ``state`` that the model does not have.
        """
        given = {self.aliases.get(k, k): v for k, v in state.items()}
        known = set(self.writer)
        out: dict[str, Any] = {}
        missing: list[str] = []
        for block_name in local_names:
            name = self._first.get(block_name)
            if name is None:
                continue
            if name in given:
                out[block_name] = given[name]
            elif name not in missing:
                missing.append(name)
        unexpected = [k for k in state if self.aliases.get(k, k) not in known]
        return out, missing, unexpected
