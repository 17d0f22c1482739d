"""What a pipeline holds: its parameters, state dicts, gradients and checkpoints.

A :class:`twobp.runtime.Pipeline` holds one :class:`PipelineState` (its
``state``): this rank's blocks as a model (``parameters()``, ``state_dict()``,
``save``/``load``, ``zero_grad``, ``clip_grad_norm_``), apart from running
steps. The pipeline's methods of the same names call it; the checkpoint code
reads and writes it, not the pipeline.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from twobp.runtime.base.group import Membership
from twobp.runtime.base.tensor_split import counted_once, refuse_checkpoint, split_dims
from twobp.runtime.base.topology import Topology
from twobp.runtime.errors import PipelineClosedError
from twobp.runtime.state import checkpoint
from twobp.runtime.state.checkpoint.tensor_shards import TensorShards
from twobp.runtime.state.grad_norm import clip_grad_norm_
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.runtime.state.model_names import ModelNames
from twobp.runtime.state.sharded_optimizer import ShardedParameters
from twobp.schedule.schedule import Schedule


class PipelineState:
    """This rank's blocks as a model, with what a checkpoint of them needs.

    Args:
        module: this rank's blocks, named by their index in the whole model.
        rank: this process's rank in the process group.
        pp_rank: this process's pipeline rank (its row of the schedule).
        topology: which process runs each stage, and which hold its replicas.
        device: this rank's device.
        timeout: seconds a rank waits on a peer.
        schedule: the compute schedule of the pipeline.
        stage_blocks: the block indices of every stage.
        aliases: each weight tied across stages by its first name in the
            whole model, with its local names (the first of them kept).
        written_blocks: the blocks whose entries this process writes to a
            checkpoint (one copy of each in the whole checkpoint).
        tied_names: every other name of a weight tied across stages (in the
            whole model), to its first.
        model_names: the names of the model the blocks were cut from
            (``twobp.split``), or None: the blocks' own.
        grad_scaler: the pipeline's :class:`twobp.GradScaler`, saved and loaded
            with the checkpoints; None: none.
    """

    def __init__(
        self,
        *,
        module: nn.Sequential,
        rank: int,
        pp_rank: int,
        topology: Topology,
        device: torch.device,
        timeout: float,
        schedule: Schedule,
        stage_blocks: tuple[range, ...],
        aliases: Mapping[str, tuple[str, ...]],
        written_blocks: frozenset[int],
        tied_names: Mapping[str, str] | None = None,
        model_names: ModelNames | None = None,
        grad_scaler: GradScaler | None = None,
    ) -> None:
        self.module = module
        self.rank = rank
        self.pp_rank = pp_rank
        self.topology = topology
        self.device = device
        self.timeout = timeout
        self.schedule = schedule
        self.n_microbatches = schedule.n_microbatches
        self.stage_blocks = stage_blocks
        self.written_blocks = written_blocks
        self._aliases = dict(aliases)
        self._tied_names = dict(tied_names or {})
        self._model_names = model_names
        self.grad_scaler = grad_scaler
        """The loss scaler of the pipeline, whose state its checkpoints keep (None: none)."""
        self.step_count = 0
        """Steps run so far (restored by :meth:`load`); the index of the next step."""
        self.background_saves = checkpoint.BackgroundSaves()
        """The checkpoint being written in the background (``save(..., async_save=True)``)."""
        self.closed = False
        """True once the pipeline is closed: checkpoints and norms are refused."""
        self.sharded: ShardedParameters | None = None
        """The shards of the pipeline's sharded optimizer (``Pipeline.shard_optimizer``)."""
        self.tensor_parallel: Any = None
        """The pipeline's :class:`twobp.runtime.setup.tensor_parallel.TensorParallel`, or None."""
        self._whole = False
        """True while a checkpoint reads or fills this rank's tensor-parallel shards."""
        self._sub_mesh: Any = None
        """The tensor-parallel sub-mesh of the checkpoints' DTensors, once made."""

    def sharded_for(self, optimizer: torch.optim.Optimizer | None) -> ShardedParameters | None:
        """The shards ``optimizer`` steps, if it is this pipeline's sharded optimizer."""
        sharded = self.sharded
        return sharded if sharded is not None and sharded.steps(optimizer) else None

    def settle_parameters(self) -> None:
        """Wait for the gathers of updated shards in flight (a sharded optimizer)."""
        if self.sharded is not None:
            self.sharded.wait()

    def check_open(self) -> None:
        """Raise :class:`PipelineClosedError` if :meth:`close` was called."""
        if self.closed:
            raise PipelineClosedError(
                f"rank {self.rank}: this pipeline was closed; build a new Pipeline to go on"
            )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This rank's parameters (complete: after a sharded optimizer's step, once its
        gathers are done)."""
        self.settle_parameters()
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in ``nn.Sequential(*blocks)`` (``3.attn.q.weight``).

        A weight tied across stages is listed once, under its first name in
        the whole model (the embedding's, on a rank that holds only the head).
        Blocks cut by ``twobp.split`` are named as in the model they come from.
        """
        self.settle_parameters()
        if self._model_names is not None:
            for name, p in self._model_names.named(self.module.named_parameters()):
                yield prefix + name, p
            return
        first = {names[0]: name for name, names in self._aliases.items()}
        for name, p in self.module.named_parameters():
            yield prefix + first.get(name, name), p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """This rank's buffers, named like :meth:`named_parameters`."""
        if self._model_names is not None:
            named = self._model_names.named(self.module.named_buffers())
            return iter([(prefix + name, b) for name, b in named])
        return self.module.named_buffers(prefix)

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers, named as in ``nn.Sequential(*blocks)``.

        A weight tied across stages appears once, under its first name. Blocks cut
        by ``twobp.split``: named as in the model's ``state_dict()``, each tensor
        once under its first name there (a checkpoint's ``merge`` gives every name).

        With ``shard_parameters=True`` the parameters are gathered for it and
        copied out: collective over the stages' copies, every rank calls it.
        """
        if not self._whole:
            refuse_checkpoint(self.tensor_parallel)
        sharded = self.sharded
        if sharded is not None and not sharded.resident:
            with sharded.gathered():
                return {k: v.clone() for k, v in self._state_dict().items()}
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        self.settle_parameters()
        if self._model_names is not None:
            return self._model_names.state_dict(self.module.state_dict())
        state = dict(self.module.state_dict())
        for name, local in self._aliases.items():
            value = state[local[0]]
            for other in local:
                del state[other]
            state[name] = value
        return state

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

        With ``shard_parameters=True``: collective over the stages' copies, every
        rank calls it.
        """
        if not self._whole:
            refuse_checkpoint(self.tensor_parallel)
        sharded = self.sharded
        if sharded is not None and not sharded.resident:
            with sharded.gathered():
                return self._load_state_dict(state_dict, strict)
        return self._load_state_dict(state_dict, strict)

    def _load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        self.settle_parameters()
        if self._model_names is not None:
            loaded = self._load_model_names(state_dict, strict)
            if self.sharded is not None:
                self.sharded.refresh_masters()
            return loaded
        local_blocks = {name for name, _ in self.module.named_children()}
        state_dict = dict(state_dict)
        for name, local in self._aliases.items():
            if name in state_dict:
                value = state_dict.pop(name)
                state_dict.update(dict.fromkeys(local, value))
        own = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in local_blocks}
        unknown = [k for k in state_dict if not k.split(".", 1)[0].isdigit()]
        result = self.module.load_state_dict(own, strict=False)
        if self.sharded is not None:
            self.sharded.refresh_masters()
        result.unexpected_keys.extend(unknown)
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(
                f"rank {self.rank}: error loading the state dict: missing keys "
                f"{result.missing_keys}, unexpected keys {result.unexpected_keys}"
            )
        return result

    def _load_model_names(self, state_dict: Mapping[str, Any], strict: bool) -> Any:
        """:meth:`load_state_dict` for blocks cut by ``twobp.split``: the model's names."""
        assert self._model_names is not None
        local = self.module.state_dict()
        own, missing, unexpected = self._model_names.to_blocks(state_dict, list(local))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"rank {self.rank}: error loading the state dict: missing keys "
                f"{missing}, unexpected keys {unexpected}"
            )
        result = self.module.load_state_dict(own, strict=False)
        result.missing_keys[:] = missing
        result.unexpected_keys[:] = unexpected
        return result

    def state_aliases(self) -> dict[str, str]:
        """Every other name of a tensor of the whole model, to the name it is saved under
        (a tied head's weight, to the embedding's): what ``merge`` adds back."""
        if self._model_names is not None:
            return dict(self._model_names.aliases)
        return dict(self._tied_names)

    def save(
        self,
        path: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        extra: Any = None,
        *,
        step: int | None = None,
        meta: Mapping[str, Any] | None = None,
        keep: int = 1,
        async_save: bool = False,
    ) -> Path:
        """Write a checkpoint into the folder of checkpoints ``path``. Collective.

        The tensors go to ``torch.distributed.checkpoint`` (DCP) format: the
        parameters and buffers and the optimizer's state under single-process
        names, and each rank's RNG states; the rest (step, schedule, stages,
        optimizer hyper-parameters, the ``grad_scaler``'s state, ``extra``) goes
        to a JSON manifest that rank
        0 writes last. The write is atomic: until the new checkpoint is
        complete, the earlier ones stay as they were (see
        :mod:`twobp.runtime.state.checkpoint`). With tensor parallelism every
        rank writes its own shards (DTensors, none joined: see
        :mod:`twobp.runtime.state.checkpoint.tensor_shards`), collective over
        every shard's pipeline.

        Args:
            path: the folder of checkpoints (shared by every rank); this one goes
                into ``path/step-<step>``.
            optimizer: an optimizer over this rank's parameters, saved with them.
            extra: JSON data to get back from :meth:`load` (the data position,
                the loss history): dicts with string keys, lists, strings,
                numbers (NaN and infinities too), booleans and None; tuples
                come back as lists. Each rank saves its own.
            step: the step to file it under; None: :attr:`step_count`.
            meta: JSON data for the manifest, readable without loading tensors
                (``twobp.runtime.state.checkpoint.read_manifest``).
            keep: how many checkpoints to keep in ``path``, this one included.
            async_save: copy the tensors and return; they are written in the
                background while training goes on. The checkpoint is complete
                once :meth:`wait_for_checkpoint` (or the next ``save`` or
                ``load``) returns; a crash before then leaves the earlier ones.

        Returns:
            The checkpoint's folder.

        Raises:
            CheckpointError: on every rank, if any rank cannot write (for a
                background write, from the call that waits for it).
        """
        self.check_open()
        with self._parameters_whole(), self._shards_named():
            return checkpoint.save(
                self, path, optimizer, extra, step=step, meta=meta, keep=keep, async_save=async_save
            )

    def wait_for_checkpoint(self) -> Path | None:
        """Wait until a checkpoint written in the background is complete. Collective.

        Returns:
            The checkpoint's folder, or None if none was being written.

        Raises:
            CheckpointError: on every rank, if any rank could not write its part.
        """
        self.check_open()
        return checkpoint.wait(self)

    def load(
        self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """Load a checkpoint written by :meth:`save`. Collective.

        The checkpoint may come from another partition, schedule, number of
        ranks or tensor-parallel size: every rank reads the tensors (and
        optimizer state) of the parameters it holds now, by name (its shard
        of a split one). The ``grad_scaler`` gets its saved
        scale back. RNG states are restored when the
        number of ranks is the same; :attr:`step_count` is restored. Nothing in
        the checkpoint is unpickled: tensors, DCP's index and JSON only.

        Args:
            path: a checkpoint, or a folder of checkpoints (its latest is loaded).
            optimizer: the optimizer to restore (the same class as saved).

        Returns:
            The ``extra`` this rank saved (rank 0's, if the checkpoint has fewer ranks).

        Raises:
            CheckpointError: on every rank, if any rank cannot load it (missing,
                incomplete, other model, of the first format of twobp: convert
                it with ``twobp checkpoint convert``); no rank's state has
                changed then.
        """
        self.check_open()
        with self._parameters_whole(), self._shards_named():
            return checkpoint.load(self, path, optimizer)

    @contextlib.contextmanager
    def _shards_named(self) -> Iterator[None]:
        """While inside, :meth:`state_dict` and :meth:`load_state_dict` give and take this
        rank's tensor-parallel shards under the whole parameters' names, for a checkpoint
        (which writes and reads them as DTensors, see :meth:`tensor_shards`)."""
        self._whole = True
        try:
            yield
        finally:
            self._whole = False

    @property
    def checkpoint_world(self) -> Membership:
        """The ranks that save and load a checkpoint together: every tensor-parallel
        shard's pipeline, or this pipeline's ranks without tensor parallelism."""
        tp = self.tensor_parallel
        return self.topology.members if tp is None else tp.world

    def tensor_shards(self) -> TensorShards:
        """Where this rank's split parameters (by name) sit in the whole tensors, for a
        checkpoint (none split without tensor parallelism)."""
        tp = self.tensor_parallel
        if tp is None:
            return TensorShards()
        if self._sub_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._sub_mesh = DeviceMesh.from_group(tp.group, self.device.type)
        by_id = split_dims(self.module)
        named = [(n, p) for n, p in self.named_parameters() if id(p) in by_id]
        return TensorShards(
            dims={n: by_id[id(p)] for n, p in named},
            shapes={n: list(p.shape) for n, p in named},
            rank=tp.rank,
            size=tp.size,
            mesh=self._sub_mesh,
        )

    def _parameters_whole(self) -> contextlib.AbstractContextManager[None]:
        """Every parameter whole inside (``shard_parameters=True``: gathered on every rank of
        the stages' copies, and freed at the end; collective), for a checkpoint."""
        if self.sharded is None:
            return contextlib.nullcontext()
        return self.sharded.gathered()

    def train(self, mode: bool = True) -> None:
        """Set training mode of the local blocks (dropout, batch norm)."""
        self.module.train(mode)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of this rank's parameters (and of a sharded optimizer's
        shards)."""
        self.module.zero_grad(set_to_none=set_to_none)
        if self.sharded is not None:
            self.sharded.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of the whole model by their global norm (over all ranks).

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the single-process model.
        With a sharded optimizer (``Pipeline.shard_optimizer``) the norm is that
        of its shards' gradients, each element counted once, and the shards are
        clipped. Collective: every rank calls it.

        Returns:
            The global norm of all gradients before clipping (a 0-dim tensor).
        """
        self.check_open()
        counted = [p for name, p in self.named_parameters() if self._writes(name)]
        world = self.topology.members
        shards = self.sharded.gradients() if self.sharded is not None else []
        counted_shards = None
        tp = self.tensor_parallel
        if tp is not None:
            # Over every pipeline: each shard once, a replicated parameter once.
            counted, world = counted_once(counted, tp.rank, self.module), tp.world
            if self.sharded is not None:
                once = {id(p) for p in counted_once(list(self.parameters()), tp.rank, self.module)}
                counted_shards = self.sharded.gradients_of(lambda p: id(p) in once)
        return clip_grad_norm_(
            self.parameters(),
            max_norm,
            norm_type,
            world,
            self.device,
            self.timeout,
            counted=counted,
            shards=shards,
            counted_shards=counted_shards,
        )

    def writes(self, name: str) -> bool:
        """True if this rank writes entry ``name`` of :meth:`state_dict` to a checkpoint."""
        return self._writes(name)

    def _writes(self, name: str) -> bool:
        """True if this rank holds the copy of parameter or buffer ``name`` that counts
        once in the whole model (the one it writes to a checkpoint)."""
        if self._model_names is not None:
            return self._model_names.writer.get(name, -1) in self.written_blocks
        return int(name.split(".", 1)[0]) in self.written_blocks
