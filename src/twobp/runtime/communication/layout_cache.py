"""Learnt boundary layouts by the shapes of a step's inputs, a bounded number of them.

What crosses a stage boundary has shapes that follow from the shapes of the
step's inputs (a block's output shape may depend on its input's shape, not on
its values). So the layouts that a step learns, the way the first step of a
pipeline does (:mod:`twobp.runtime.communication.channel`), hold for every
later step whose inputs have the same *signature*: the shapes, dtypes and
gradient flags of the input tensors. Only the rank of the first stage sees
the inputs; it looks the signature up and tells every rank, in the small
agreement that opens each step (:mod:`twobp.runtime.execution.step_start`),
which slot of layouts the step uses and whether the step learns it afresh. A
step whose signature was seen before thus sends no layout message and
allocates every receive from known layouts.

At most :data:`LAYOUT_SLOTS` signatures are kept; a new one takes the slot of
the one used least recently. The rank of the first stage alone decides, so
every rank holds the same slots without comparing anything more.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, MutableMapping

import torch

from twobp.runtime.communication.tensor_layout import BoundaryMeta

LAYOUT_SLOTS = 15
"""The most input signatures whose layouts a pipeline keeps (for training, and again for
evaluation)."""

SLOT_BITS = 5
"""Bits of the slot code in the step's agreement (room for ``2 * LAYOUT_SLOTS + 1`` codes)."""

NO_SLOT = 0
"""The slot code of a rank that does not decide (it holds no inputs)."""

BoundaryLayouts = MutableMapping[tuple[int, int], BoundaryMeta]
"""The activation layout of each remote boundary, by (boundary, rows of the micro-batch)."""

Signature = Hashable
"""What decides the layouts of a step: see :func:`input_signature`."""


def input_signature(tensors: tuple[torch.Tensor, ...], is_tuple: bool) -> Signature:
    """The shapes, dtypes and gradient flags of a step's input tensors."""
    return (is_tuple, tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors))


class LayoutCache:
    """The layouts learnt for at most ``slots`` input signatures, least recently used out.

    Every rank holds one per kind of call (training, evaluation). The rank
    that decides (the one of the first stage) calls :meth:`propose` before
    the step's agreement; once every rank agreed, each calls :meth:`settle`
    with the code the deciding rank sent.

    Args:
        slots: how many signatures to keep (at most :data:`LAYOUT_SLOTS`).
    """

    def __init__(self, slots: int = LAYOUT_SLOTS) -> None:
        if not 1 <= slots <= LAYOUT_SLOTS:
            raise ValueError(f"a layout cache holds 1 to {LAYOUT_SLOTS} slots, not {slots}")
        self._size = slots
        self._slots: list[dict[tuple[int, int], BoundaryMeta]] = [{} for _ in range(slots)]
        self._recent: OrderedDict[Signature, int] = OrderedDict()
        """On the deciding rank: the slot of each signature, least recently used first."""

    def propose(self, signature: Signature) -> int:
        """The slot code for a step of ``signature`` (nothing changes until :meth:`settle`)."""
        slot = self._recent.get(signature)
        if slot is not None:
            return 1 + slot
        free = sorted(set(range(self._size)) - set(self._recent.values()))
        slot = free[0] if free else next(iter(self._recent.values()))
        return 1 + self._size + slot

    def settle(self, code: int, signature: Signature | None = None) -> BoundaryLayouts:
        """The layouts of the step that every rank agreed on ``code``.

        Args:
            code: the deciding rank's code (:meth:`propose`).
            signature: on the deciding rank, the step's signature (its use
                is recorded); None elsewhere.

        Returns:
            The slot's layouts, emptied first when the step learns them.

        Raises:
            ValueError: if ``code`` names no slot.
        """
        if not 1 <= code <= 2 * self._size:
            raise ValueError(f"layout slot code {code} is not one of 1 to {2 * self._size}")
        learn = code > self._size
        slot = (code - 1) % self._size
        if signature is not None:
            if learn:
                for old in [s for s, n in self._recent.items() if n == slot]:
                    del self._recent[old]
                self._recent[signature] = slot
            self._recent.move_to_end(signature)
        if learn:
            self._slots[slot] = {}
        return self._slots[slot]

    def forget(self, code: int) -> None:
        """Drop the layouts of slot code ``code``: its step failed on some rank, and every
        rank forgets them alike (the next step of its signature learns them again)."""
        slot = (code - 1) % self._size
        self._slots[slot] = {}
        for old in [s for s, n in self._recent.items() if n == slot]:
            del self._recent[old]

    def learns(self, code: int) -> bool:
        """True if a step of slot code ``code`` learns its layouts afresh."""
        return code > self._size

    def clear(self) -> None:
        """Forget every layout (the pipeline closes)."""
        self._slots = [{} for _ in range(self._size)]
        self._recent.clear()
