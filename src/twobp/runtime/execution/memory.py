"""What a rank holds between its passes, measured: the figures of ``Pipeline.memory_stats``.

A :class:`MemoryMeter` is shared by the stages of one rank. Each stage tells
it what it holds of a micro-batch and under which heading:

* ``"activations"``, from ``F`` until ``I`` (or ``B``): the tensors autograd
  saved in the forward (seen by a saved-tensor hook), the stage's inputs and
  outputs; with activation recomputation, the inputs only;
* ``"stash"``, from ``I`` until ``W``: what the 2BP engine stashed for ``W``;
  with derivative checkpointing, the inputs and output gradients instead.

Tensors are counted by their storages, each storage once (a view keeps its
whole storage alive); the storages of parameters and buffers are not counted
there. The saved-tensor hook costs a Python call per saved tensor (about 40
in a LLaMA-like block, 1.3-2.6 ms on a forward of two such blocks on a CPU),
so it watches a stage's forward once per *signature*: the shapes and dtypes of
the stage's inputs and target, and which of its parameters require a
gradient. Every later forward of that signature, in this step or a later one,
saves as many bytes beyond its inputs, outputs and target, which the meter
counts for it; the figures of the :data:`SIGNATURES_KEPT` signatures used
last are kept, so batches of ever new shapes cost one watched forward per
new shape and no memory beyond that. (An operation whose saved sizes depend on the values rather
than the shapes, a data-dependent routing, keeps the figure first seen.) The
meter keeps the peak of each heading, and of both together, over the step,
sampled after each pass and after each recomputed forward.
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

StorageKey = tuple[str, int]
"""A storage: its device and its address."""
Signature = tuple[Any, ...]
"""What decides the bytes a stage's forward saves (see :func:`forward_signature`)."""

ACTIVATIONS = "activations"
STASH = "stash"
SIGNATURES_KEPT = 64
"""How many (stage, signature) figures of watched forwards a meter keeps, the least
recently used dropped first."""


def storages(tensors: Iterable[Any]) -> dict[StorageKey, int]:
    """The storages that ``tensors`` keep alive and their bytes (non-tensors are skipped)."""
    found: dict[StorageKey, int] = {}
    names = _DEVICE_NAMES
    with torch._C.DisableTorchFunction():
        for t in tensors:
            if not isinstance(t, Tensor):
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass)
                continue
            device = t.device
            name = names.get(device)
            if name is None:
                name = names[device] = str(device)
            found[(name, storage.data_ptr())] = storage.nbytes()
    return found


_DEVICE_NAMES: dict[torch.device, str] = {}
"""``str(device)`` by device: :func:`storages` names one per tensor, several times per action."""


class HeldStorages:
    """The storages of some tensors, by key, for as long as they hold their elements.

    A sharded stage's weights are freed within the step (their storages resized to
    nothing); a tensor allocated at their address afterwards is another storage with
    the same key, and is counted.
    """

    def __init__(self, tensors: Iterable[Tensor] = ()) -> None:
        self._storages: dict[StorageKey, torch.UntypedStorage] = {}
        with torch._C.DisableTorchFunction():
            for t in tensors:
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass)
                    continue
                self._storages[(str(t.device), storage.data_ptr())] = storage

    def __contains__(self, key: StorageKey) -> bool:
        storage = self._storages.get(key)
        return storage is not None and storage.data_ptr() == key[1]


class MemoryMeter:
    """The bytes one rank's stages hold between passes, and their peaks in the step.

    Args:
        device: the rank's device; on CUDA the step start resets its peak
            allocation statistics, which :func:`memory_stats` reads.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._excluded = HeldStorages()
        self._held: dict[tuple[str, Any], dict[StorageKey, int]] = {}
        self._refs: dict[str, dict[StorageKey, int]] = {ACTIVATIONS: {}, STASH: {}, "": {}}
        self._bytes = {ACTIVATIONS: 0, STASH: 0, "": 0}
        self.peaks = {ACTIVATIONS: 0, STASH: 0, "": 0}
        """The most bytes held at once in the last step: per heading, and ``""`` for both."""
        self._saved_beyond: OrderedDict[tuple[int, Signature], int] = OrderedDict()

    def start_step(self, modules: Iterable[nn.Module]) -> None:
        """Forget the last step's holdings; parameters and buffers of ``modules`` are
        not counted. What watched forwards saved (:meth:`learn_saved`) is kept."""
        self._excluded = HeldStorages(t for m in modules for t in (*m.parameters(), *m.buffers()))
        self._held.clear()
        for heading in self._refs:
            self._refs[heading].clear()
            self._bytes[heading] = self.peaks[heading] = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def saved(self, found: dict[StorageKey, int]) -> Iterator[None]:
        """Add to ``found`` the storages of the tensors autograd saves inside the block."""
        excluded = self._excluded

        def pack(t: Tensor) -> Tensor:
            for key, size in storages((t,)).items():
                if key not in excluded:
                    found[key] = size
            # Detached: a saved output must not hold its own graph node (a cycle).
            with torch._C.DisableTorchFunction():
                return t.detach()

        hooks = pack, _unpack
        if "torch._dynamo" in sys.modules:
            # Dynamo would trace the hooks while it compiles a block (and break
            # its graph on the storage sizes); they run as they are.
            disable: Any = torch.compiler.disable
            hooks = disable(pack), disable(_unpack)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            yield

    def saved_beyond(self, stage: int, signature: Signature) -> int | None:
        """What a watched forward of ``stage`` with this ``signature`` saved beyond its
        inputs, outputs and target, in bytes; None before one (which :meth:`saved`
        must watch)."""
        key = (stage, signature)
        if key not in self._saved_beyond:
            return None
        self._saved_beyond.move_to_end(key)
        return self._saved_beyond[key]

    def learn_saved(
        self,
        stage: int,
        signature: Signature,
        saved: dict[StorageKey, int],
        kept: dict[StorageKey, int],
    ) -> None:
        """Record what a watched forward of ``stage`` saved beyond ``kept`` (its inputs,
        outputs and target), for :meth:`saved_beyond` of the same ``signature``."""
        self._saved_beyond[(stage, signature)] = sum(
            size for key, size in saved.items() if key not in kept and key not in self._excluded
        )
        while len(self._saved_beyond) > SIGNATURES_KEPT:
            self._saved_beyond.popitem(last=False)

    def hold(self, heading: str, key: Any, held: dict[StorageKey, int]) -> None:
        """Count ``held`` under ``heading`` until :meth:`release` of the same ``key``."""
        held = {k: v for k, v in held.items() if k not in self._excluded}
        self.release(heading, key)
        self._held[(heading, key)] = held
        for name in (heading, ""):
            refs = self._refs[name]
            for k, size in held.items():
                count = refs.get(k, 0)
                if count == 0:
                    self._bytes[name] += size
                refs[k] = count + 1

    def release(self, heading: str, key: Any) -> None:
        """Stop counting what :meth:`hold` counted under ``heading`` and ``key``."""
        held = self._held.pop((heading, key), None)
        if held is None:
            return
        for name in (heading, ""):
            refs = self._refs[name]
            for k, size in held.items():
                count = refs[k] - 1
                if count == 0:
                    del refs[k]
                    self._bytes[name] -= size
                else:
                    refs[k] = count

    @property
    def held(self) -> int:
        """Bytes of activations and stashes held now."""
        return self._bytes[""]

    def sample(self, transient: dict[StorageKey, int] | None = None) -> None:
        """Update the peaks with what is held now, plus ``transient`` storages held in passing."""
        extra = 0
        if transient:
            refs = self._refs[""]
            extra = sum(
                v for k, v in transient.items() if k not in refs and k not in self._excluded
            )
        for name in (ACTIVATIONS, STASH):
            self.peaks[name] = max(self.peaks[name], self._bytes[name])
        self.peaks[""] = max(self.peaks[""], self._bytes[""] + extra)


def forward_signature(
    tensors: Iterable[Tensor], parameters: Iterable[Tensor], recompute: Any = None
) -> Signature:
    """The shapes and dtypes of a stage's ``tensors`` (inputs and target), which of its
    ``parameters`` require a gradient, and its recompute mode.

    ``parameters`` is a list the stage keeps: walking ``module.parameters()`` on every
    forward took most of this function's time (~40 us for six decoder blocks)."""
    with torch._C.DisableTorchFunction():
        shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
        trained = tuple(p.requires_grad for p in parameters)
    return (shapes, trained, recompute)


def _unpack(t: Tensor) -> Tensor:
    return t


def memory_stats(
    meter: MemoryMeter,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    aside: int = 0,
) -> dict[str, int]:
    """The memory figures of one rank for its last step, in bytes.

    Args:
        meter: the rank's meter.
        module: the rank's blocks.
        optimizer: its optimizer, whose state is counted; None counts none.
        aside: bytes of earlier steps' gradients held aside during the step
            (gradient accumulation), counted in the peak.

    Returns:
        ``activations`` and ``stash`` (peaks, see :class:`MemoryMeter`);
        ``parameters``: parameters, their gradients (or, with a sharded
        optimizer, its shards' gradients) and buffers; ``optimizer``: the
        optimizer's state tensors, and its parameters that are not the
        model's (a sharded optimizer's float32 master shards); ``peak``: on CUDA the
        most memory allocated on the device since the step started
        (``torch.cuda.max_memory_allocated``), elsewhere ``parameters +
        optimizer`` plus the most held at once between passes and the
        earlier steps' gradients held aside (``aside``).
    """
    tensors: list[Tensor] = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    state: list[Any] = []
    if optimizer is not None:
        for values in optimizer.state.values():
            state.extend(values.values() if isinstance(values, dict) else ())
        own = storages(module.parameters())
        for group in optimizer.param_groups:
            for p in group["params"]:
                # A sharded optimizer's shards: views of the parameters, or float32 masters.
                if p.grad is not None:
                    tensors.append(p.grad)
                if not own.keys() >= storages([p]).keys():
                    state.append(p)
    parameters = sum(storages(tensors).values())
    optimizer_bytes = sum(storages(state).values())
    if meter.device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(meter.device))
    else:
        peak = parameters + optimizer_bytes + meter.peaks[""] + aside
    return {
        "activations": meter.peaks[ACTIVATIONS],
        "stash": meter.peaks[STASH],
        "parameters": parameters,
        "optimizer": optimizer_bytes,
        "peak": peak,
    }
