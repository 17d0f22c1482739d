"""Running a stage's forward again, exactly: random number states and buffer checks.

A recomputed forward must give the tensors of the first one, bit for bit, or
the gradients change. :class:`RngState` keeps the CPU and CUDA generator
states taken before a micro-batch's first forward and replays them around
the recomputation (dropout draws the same masks), leaving the generators as
they were. :class:`BufferCheck` catches what can be caught of a forward that
is not repeatable: a buffer changed (or replaced) by the second run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from twobp.runtime.errors import NonRepeatableForwardError


@dataclass(frozen=True)
class RngState:
    """The generator states a forward started from.

    Args:
        cpu: the default CPU generator's state.
        cuda: the state of the CUDA generator of ``device``, or None.
        device: the CUDA device, or None on the CPU.
    """

    cpu: Tensor
    cuda: Tensor | None
    device: torch.device | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """The states now, of the CPU generator and of ``device``'s if it is a CUDA device."""
        if device.type == "cuda":
            return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device), device)
        return cls(torch.get_rng_state(), None, None)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block inside from these states; the generators come back as they were."""
        device = self.device
        cpu = torch.get_rng_state()
        cuda = None if device is None else torch.cuda.get_rng_state(device)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and device is not None:
            torch.cuda.set_rng_state(self.cuda, device)
        try:
            yield
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None and device is not None:
                torch.cuda.set_rng_state(cuda, device)


class BufferCheck:
    """The buffers of a stage module before a recomputed forward, to compare after it.

    A buffer replaced is another tensor; one changed in place bumps its
    version counter, or (where a kernel writes it without doing so, as
    BatchNorm's running statistics) holds other values. None of that may
    happen in a repeatable forward.

    Args:
        module: the stage module (children named by global block index).
        model_name: an entry's name in the model the blocks were cut from
            (``3.layers.0.bn.running_mean`` -> ``layers.0.bn.running_mean``),
            None where it has none; None: the block names are the names.
    """

    def __init__(
        self, module: nn.Module, model_name: Callable[[str], str | None] | None = None
    ) -> None:
        self._module = module
        self._model_name = model_name
        self._before = {name: (id(b), b._version) for name, b in module.named_buffers()}
        self._values = {name: b.clone() for name, b in module.named_buffers()}

    def verify(self, where: str, mode: str) -> None:
        """Raise if a buffer changed since construction.

        Args:
            where: names the rank, stage and micro-batch (``"rank 1 stage 1,
                micro-batch 3"``).
            mode: the recompute mode, for the message.

        Raises:
            NonRepeatableForwardError: naming the block and its changed buffers.
        """
        buffers = dict(self._module.named_buffers())
        changed = [
            n
            for n, b in buffers.items()
            if self._before.get(n) != (id(b), b._version) or not _same(self._values[n], b)
        ]
        changed += [n for n in self._before if n not in buffers]
        if not changed:
            return
        # One line however many modules changed: the first by name, the others counted.
        owners: dict[str, list[str]] = {}
        for name in changed:
            owners.setdefault(name.rpartition(".")[0], []).append(name)
        first, names = next(iter(owners.items()))
        kind = type(self._module.get_submodule(first)).__name__
        leaves = ", ".join(n.rpartition(".")[2] for n in names)
        others = len(owners) - 1
        also = f", and {others} other module{'s' if others > 1 else ''} theirs" if others else ""
        raise NonRepeatableForwardError(
            f"{where}: recompute={mode!r} ran the forward again and {self._shown(names[0])} "
            f"({kind}) changed its {leaves}{also}: the forward is not repeatable, so the "
            "recomputed gradients would be wrong (BatchNorm in training mode updates its "
            "running statistics on every forward). Run this stage without recomputation "
            "(recompute=[..., None, ...], one mode per stage) or put those modules in eval mode"
        )

    def _shown(self, buffer: str) -> str:
        """The module holding ``buffer``, named as the model names it, else ``block N``'s."""
        named = self._model_name(buffer) if self._model_name is not None else None
        owner = (named or buffer).rpartition(".")[0]
        return owner if named is not None else f"block {owner}"


def _same(before: Tensor, after: Tensor) -> bool:
    if before.is_floating_point() or before.is_complex():
        return bool(torch.allclose(before, after, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(before, after))
