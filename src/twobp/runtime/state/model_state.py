"""What a pipeline holds: its parameters, state dicts, gradients and checkpoints.

:class:`PipelineState` is the part of :class:`twobp.runtime.Pipeline` that
deals with this rank's blocks as a model (``parameters()``, ``state_dict()``,
``save``/``load``, ``zero_grad``, ``clip_grad_norm_``), apart from running steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from twobp.runtime.errors import PipelineClosedError
from twobp.runtime.setup.topology import Topology
from twobp.runtime.state import checkpoint
from twobp.runtime.state.grad_norm import clip_grad_norm_
from twobp.schedule.schedule import Schedule

S = TypeVar("S", bound="PipelineState")


class PipelineState:
    """This rank's blocks as a model; mixed into :class:`twobp.runtime.Pipeline`."""

    module: nn.Sequential
    """This rank's blocks, named by their index in the whole model."""
    rank: int
    pp_rank: int
    topology: Topology
    device: torch.device
    timeout: float
    step_count: int
    schedule: Schedule
    n_microbatches: int
    stage_blocks: tuple[range, ...]
    _closed: bool

    def _check_open(self) -> None:
        """Raise :class:`PipelineClosedError` if :meth:`close` was called."""
        if self._closed:
            raise PipelineClosedError(
                f"rank {self.rank}: this pipeline was closed; build a new Pipeline to go on"
            )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in ``nn.Sequential(*blocks)`` (``3.attn.q.weight``)."""
        return self.module.named_parameters(prefix)

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """This rank's buffers, named like :meth:`named_parameters`."""
        return self.module.named_buffers(prefix)

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers, named as in ``nn.Sequential(*blocks)``."""
        return dict(self.module.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's entries of a state dict of the whole model (or of this rank).

        Entries of blocks on other ranks are ignored, so every rank can load
        the same single-process ``state_dict``.

        Args:
            state_dict: names as in ``nn.Sequential(*blocks).state_dict()``.
            strict: raise if an entry of a local block is missing or unknown.

        Returns:
            torch's ``(missing_keys, unexpected_keys)`` for the local blocks.

        Raises:
            RuntimeError: with ``strict``, on missing or unexpected local keys.
        """
        local_blocks = {name for name, _ in self.module.named_children()}
        own = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in local_blocks}
        unknown = [k for k in state_dict if not k.split(".", 1)[0].isdigit()]
        result = self.module.load_state_dict(own, strict=False)
        result.unexpected_keys.extend(unknown)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"rank {self.rank}: error loading the state dict: missing keys "
                f"{result.missing_keys}, unexpected keys {result.unexpected_keys}"
            )
        return result

    def save(
        self,
        path: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
        *,
        step: int | None = None,
        meta: Mapping[str, Any] | None = None,
        keep: int = 1,
    ) -> Path:
        """Write a checkpoint into the folder of checkpoints ``path``. Collective.

        Each rank writes its parameters and buffers (single-process names), the
        optimizer's state keyed by parameter name, its RNG states and ``extra``;
        rank 0 adds a manifest. The write is atomic: until the new checkpoint is
        complete, the earlier ones stay as they were (see
        :mod:`twobp.runtime.state.checkpoint`).

        Args:
            path: the folder of checkpoints (shared by every rank); this one goes
                into ``path/step-<step>``.
            optimizer: an optimizer over this rank's parameters, saved with them.
            extra: anything picklable to get back from :meth:`load` (the data
                position, the loss history); each rank saves its own.
            step: the step to file it under; None: :attr:`step_count`.
            meta: JSON data for the manifest, readable without loading tensors
                (``twobp.runtime.state.checkpoint.read_manifest``).
            keep: how many checkpoints to keep in ``path``, this one included.

        Returns:
            The checkpoint's folder.

        Raises:
            CheckpointError: on every rank, if any rank cannot write.
        """
        self._check_open()
        return checkpoint.save(self, path, optimizer, extra, step=step, meta=meta, keep=keep)

    def load(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """Load a checkpoint written by :meth:`save`. Collective.

        The checkpoint may come from another partition, schedule or number of
        ranks: every rank takes the tensors (and optimizer state) of the
        parameters it holds now, by name. RNG states are restored when the
        number of ranks is the same; :attr:`step_count` is restored.

        Args:
            path: a checkpoint, or a folder of checkpoints (its latest is loaded).
            optimizer: the optimizer to restore (the same class as saved).

        Returns:
            The ``extra`` this rank saved (rank 0's, if the checkpoint has fewer ranks).

        Raises:
            CheckpointError: on every rank, if any rank cannot load it (missing,
                incomplete, other model); no rank's state has changed then.
        """
        self._check_open()
        return checkpoint.load(self, path, optimizer)

    def train(self: S, mode: bool = True) -> S:
        """Set training mode of the local blocks (dropout, batch norm)."""
        self.module.train(mode)
        return self

    def eval(self: S) -> S:
        """Set evaluation mode of the local blocks."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters."""
        self.module.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of the whole model by their global norm (over all ranks).

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the single-process model.
        Collective: every rank calls it.

        Returns:
            The global norm of all gradients before clipping (a 0-dim tensor).
        """
        self._check_open()
        return clip_grad_norm_(
            self.parameters(), max_norm, norm_type, self.topology.members, self.device, self.timeout
        )
