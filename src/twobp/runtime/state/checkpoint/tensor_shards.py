"""Tensor-parallel shards in a checkpoint: each rank writes its own, as DTensors; none joins.

With tensor parallelism rank ``t`` of a tensor-parallel group of ``T`` holds chunk
``t`` of ``T`` equal chunks of every split parameter, along the dim its style
splits (:func:`twobp.runtime.base.tensor_split.split_dims`). A checkpoint keeps
each such tensor under its whole name and shape, as DCP chunks:

- a split parameter, and each optimizer state tensor of its shard's shape, is
  written by every tensor-parallel rank that writes the parameter, as a
  ``DTensor`` on the tensor-parallel sub-mesh with the placement ``Shard(dim)``:
  DCP's metadata lists one chunk per rank, each in the file of the rank that
  wrote it;
- a sharded optimizer's flat ranges of a shard are boxes of the shard (see
  :mod:`.shards`), moved to where the shard sits in the whole tensor;
- everything that is not split (replicated parameters, buffers, a 0-dim state
  such as AdamW's ``step``, the RNG states, the JSON part) is written by the
  pipeline of tensor-parallel rank 0 alone.

Loading at any ``T`` (1 included) reads through DCP's resharding: each rank
asks for its shard of the loading layout, as a ``DTensor`` (or a whole tensor
where nothing is split), and DCP reads the parts of the saved chunks that
cover it. Without tensor parallelism a :class:`TensorShards` has no split
parameters, and every entry is a plain tensor: one code path for both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from twobp.runtime.state.checkpoint.entries import MASTER, MODEL, OPTIMIZER_STATE

# torch.distributed.checkpoint loads on first use (see twobp.runtime.state.lazy)
from twobp.runtime.state.lazy import storage


@dataclass(frozen=True)
class TensorShards:
    """Where this rank's shards sit in the whole tensors of a checkpoint.

    Args:
        dims: each split parameter's name, to the dim its shards are cut along.
        shapes: each split parameter's name, to its shard's (local) shape.
        rank: this rank's index in its tensor-parallel group.
        size: ranks per tensor-parallel group (1: nothing split).
        mesh: the tensor-parallel sub-mesh (a 1-D ``DeviceMesh`` over the group's
            ranks) the shards' DTensors live on; None without tensor parallelism.
    """

    dims: Mapping[str, int] = field(default_factory=dict)
    shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    rank: int = 0
    size: int = 1
    mesh: Any = field(default=None, repr=False)

    @property
    def writes_replicated(self) -> bool:
        """True on the rank that writes what is not split (tensor-parallel rank 0)."""
        return self.rank == 0

    def whole_shape(self, name: str, shape: Sequence[int]) -> list[int]:
        """The whole shape of parameter ``name`` whose shard here has ``shape``."""
        whole = [int(n) for n in shape]
        if name in self.dims:
            whole[self.dims[name]] *= self.size
        return whole

    def local_shape(self, name: str, whole: Sequence[int]) -> list[int]:
        """This rank's shard of parameter ``name`` of the whole shape ``whole``."""
        local = [int(n) for n in whole]
        if name in self.dims:
            local[self.dims[name]] //= self.size
        return local

    def offsets(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """Where the shard of ``name`` (of ``shape``) starts in the whole tensor."""
        at = [0] * len(shape)
        if name in self.dims:
            at[self.dims[name]] = self.rank * int(shape[self.dims[name]])
        return tuple(at)

    def pieces(
        self, name: str, shape: Sequence[int], boxes: Sequence[tuple[tuple[int, ...], Tensor]]
    ) -> Any:
        """Boxes of the shard of parameter ``name`` (of ``shape``, boxes at offsets in the
        shard) as :class:`~.storage.Pieces` of the whole tensor."""
        start = self.offsets(name, shape)
        moved = [(tuple(o + s for o, s in zip(at, start, strict=True)), t) for at, t in boxes]
        dtype = boxes[0][1].dtype if boxes else torch.float32
        return storage.Pieces(self.whole_shape(name, shape), dtype, moved)

    def saved(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's entries to write, of all it has: each shard as a DTensor of the whole
        tensor, what is not split on tensor-parallel rank 0 only."""
        out: dict[str, Any] = {}
        for name, value in tensors.items():
            owner = _owner(name)
            if isinstance(value, storage.Pieces):
                if owner in self.dims or self.writes_replicated:
                    out[name] = value
            elif owner in self.dims and list(value.shape) == list(self.shapes[owner]):
                out[name] = self._dtensor(owner, _own_storage(value.detach()))
            elif self.writes_replicated:
                out[name] = value
        return out

    def target(self, name: str, whole: Sequence[int], dtype: torch.dtype) -> Any:
        """What DCP fills to load entry ``name`` (saved of the shape ``whole``): this rank's
        shard as a DTensor if it belongs to a split parameter, else the whole tensor."""
        owner = _owner(name)
        if owner in self.dims and list(whole) == self.whole_shape(owner, self.shapes[owner]):
            return self._dtensor(owner, torch.empty(self.shapes[owner], dtype=dtype))
        return torch.empty(list(whole), dtype=dtype)

    def _dtensor(self, owner: str, local: Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        whole = torch.Size(self.whole_shape(owner, local.shape))
        stride = torch.empty(whole, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh, [Shard(self.dims[owner])], run_check=False,
            shape=whole, stride=stride,
        )  # fmt: skip


def local(value: Any) -> Any:
    """``value`` with every DTensor in it (in dicts) as its local tensor, after a load."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    return value.to_local() if isinstance(value, DTensor) else value


def _own_storage(tensor: Tensor) -> Tensor:
    """``tensor``, or a copy if it is a view into a larger storage (a parameter of a sharded
    optimizer's flat buffer): DCP's background copy of a CPU DTensor deep-copies the
    DTensor, its local tensor's whole storage with it."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone()


def _owner(name: str) -> str:
    """The parameter an entry belongs to (``""``: none, an RNG state)."""
    if name.startswith(MODEL):
        return name[len(MODEL) :]
    if name.startswith(OPTIMIZER_STATE):
        return name[len(OPTIMIZER_STATE) :].rsplit(".", 1)[0]
    if name.startswith(MASTER):
        return name[len(MASTER) :]
    return ""
