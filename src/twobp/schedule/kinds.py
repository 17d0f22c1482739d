"""Action kinds and what each one means: the one table that everything reads.

An action *requires* results of other actions and *produces* results. A
result is named by a key ``(stage, tag, micro-batch)``. Each kind has one
entry, a :class:`KindSpec`:

* ``needs``: the results it waits for, each a tag on the stage at an offset
  (``F`` of stage ``s`` needs ``F`` of stage ``s - 1``); a need on a stage
  that does not exist is no need (stage 0 waits for no forward);
* ``makes``: the tags it produces, one result per micro-batch it covers;
* ``via``: the receive that carries a need between two ranks once the
  schedule is lowered (a transfer it implies: ``F`` of stage ``s`` implies a
  ``SEND_F`` on stage ``s - 1`` and a ``RECV_F`` on ``s`` when the two stages
  are on different ranks);
* ``link``: for a transfer action, the stage at the other end (its offset);
* ``cost``: the field of ``twobp.sim.CostModel`` that holds its time
  (``None``: it takes no time);
* ``label`` and ``colour``: how legends and pictures show it.

The table, with ``S`` stages, ``s`` a stage, ``m`` a micro-batch::

    kind    needs                              makes      cost
    F       F(s-1, m) via RECV_F               F          forward
    I       F(s, m), BI(s+1, m) via RECV_B     BI         backward_input
    W       BI(s, m) for each m covered        W          backward_weight
    B       as I                               BI, W      backward_full
    SEND_F  F(s, m)                            SEND_F     -   (link s+1)
    RECV_F  SEND_F(s-1, m)                     RECV_F     -   (link s-1)
    SEND_B  BI(s, m)                           SEND_B     -   (link s-1)
    RECV_B  SEND_B(s+1, m)                     RECV_B     -   (link s+1)
    R       W(s, m) for each m covered         R          reduce  (in the background)

``R`` reduces a stage's weight gradients over the ranks that hold a replica
of it (data parallel, Chimera's two pipelines, weights tied across stages):
it covers every micro-batch of the stage, so it starts once the stage's last
``W`` (or ``B``) is done, and runs *in the background*: its rank goes on at
once while the all-reduce proceeds.

``BI`` is the gradient with respect to a stage's input. A new kind is one
entry: :func:`register_kind` adds it, after which actions of that kind parse,
validate, simulate and draw. This module imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType


class Kind(str, Enum):
    """What an action does."""

    FORWARD = "F"
    """Forward of one micro-batch."""
    FULL_BACKWARD = "B"
    """Backward of one micro-batch, input and weight gradients fused."""
    BACKWARD_INPUT = "I"
    """Backward-p1: gradients with respect to the stage inputs only."""
    BACKWARD_WEIGHT = "W"
    """Backward-p2: weight gradients of one or several micro-batches."""
    SEND_F = "SEND_F"
    """Send a forward output to the next stage."""
    RECV_F = "RECV_F"
    """Receive a forward input from the previous stage."""
    SEND_B = "SEND_B"
    """Send an input gradient to the previous stage."""
    RECV_B = "RECV_B"
    """Receive an output gradient from the next stage."""
    REDUCE = "R"
    """Reduce a stage's weight gradients over its replicas, in the background."""

    @property
    def is_compute(self) -> bool:
        """True for F, B, I, W (and declared kinds that are no transfer); False for transfers."""
        return kind_spec(self).is_compute

    def __str__(self) -> str:
        return self.value


COST_FIELDS = ("forward", "backward_input", "backward_weight", "backward_full", "reduce")
"""The times per stage of ``twobp.sim.CostModel`` that a kind may take."""


@dataclass(frozen=True)
class Need:
    """A result an action waits for, for every micro-batch it covers.

    Args:
        tag: what the result is (a tag some kind ``makes``).
        offset: the stage that makes it, relative to the action's stage.
        via: the receive kind that carries it when that stage is on another
            rank and the schedule is lowered; ``None`` if it never crosses.
    """

    tag: str
    offset: int = 0
    via: str | None = None


@dataclass(frozen=True)
class KindSpec:
    """What an action kind means; one entry of the table.

    Args:
        code: the kind's text in an action (``F`` in ``1F0``); upper-case
            letters and ``_``.
        label: a short human name, for legends.
        needs: the results it waits for.
        makes: the tags of the results it produces.
        cost: the ``CostModel`` field of its time (one of
            :data:`COST_FIELDS`), or ``None`` if it takes no time.
        link: for a transfer action, the offset of the stage at the other
            end; ``None`` for compute.
        several: whether one action may cover several micro-batches.
        colour: its colour in pictures, or ``None`` for a neutral one.
        background: the kind runs beside its rank's compute (an asynchronous
            collective): the rank goes on at once, and its result is there
            ``cost`` later.
    """

    code: str
    label: str
    needs: tuple[Need, ...] = ()
    makes: tuple[str, ...] = ()
    cost: str | None = None
    link: int | None = None
    several: bool = False
    colour: str | None = None
    background: bool = False

    @property
    def is_compute(self) -> bool:
        """True unless the kind is a transfer between ranks."""
        return self.link is None


_BACKWARD_NEEDS = (Need("F"), Need("BI", +1, via="RECV_B"))

# Colour-blind-safe (Okabe-Ito) colours for the compute kinds.
_TABLE: dict[str, KindSpec] = {
    spec.code: spec
    for spec in (
        KindSpec(
            "F", "forward", (Need("F", -1, via="RECV_F"),), ("F",), "forward", colour="#56B4E9"
        ),
        KindSpec(
            "I", "backward-p1 (I)", _BACKWARD_NEEDS, ("BI",), "backward_input", colour="#E69F00"
        ),
        KindSpec(
            "W",
            "backward-p2 (W)",
            (Need("BI"),),
            ("W",),
            "backward_weight",
            several=True,
            colour="#009E73",
        ),
        KindSpec("B", "backward", _BACKWARD_NEEDS, ("BI", "W"), "backward_full", colour="#CC79A7"),
        KindSpec(
            "R",
            "gradient reduction (R)",
            (Need("W"),),
            ("R",),
            "reduce",
            several=True,
            colour="#D55E00",
            background=True,
        ),
        KindSpec("SEND_F", "send_f", (Need("F"),), ("SEND_F",), link=+1),
        KindSpec("RECV_F", "recv_f", (Need("SEND_F", -1),), ("RECV_F",), link=-1),
        KindSpec("SEND_B", "send_b", (Need("BI"),), ("SEND_B",), link=-1),
        KindSpec("RECV_B", "recv_b", (Need("SEND_B", +1),), ("RECV_B",), link=+1),
    )
}

KINDS: Mapping[str, KindSpec] = MappingProxyType(_TABLE)
"""Every kind by its code, built-in and registered, in table order."""

_BUILT_IN = frozenset(_TABLE)
_CODE = re.compile(r"[A-Z][A-Z_]*")


def kind_spec(kind: Kind | str) -> KindSpec:
    """The table entry of ``kind`` (a :class:`Kind` or its code).

    Raises:
        ValueError: if no kind has that code.
    """
    code = kind.value if isinstance(kind, Kind) else kind
    spec = _TABLE.get(code)
    if spec is None:
        raise ValueError(f"unknown action kind {code!r}; kinds are {', '.join(_TABLE)}")
    return spec


def register_kind(spec: KindSpec) -> Kind:
    """Add a kind to the table; from then on ``Kind(spec.code)`` is that kind.

    Validation, the walker, the simulators, the cost model and the pictures
    read the table, so the new kind needs nothing else. The runtime does
    not run it.

    Args:
        spec: the new kind's entry.

    Returns:
        The kind, a member of :class:`Kind` for every purpose but iteration
        over ``Kind`` (which lists the built-in kinds).

    Raises:
        ValueError: if the code is taken or malformed, or ``cost`` is not one
            of :data:`COST_FIELDS`.
    """
    if spec.code in _TABLE:
        raise ValueError(f"action kind {spec.code!r} exists already")
    if not _CODE.fullmatch(spec.code):
        raise ValueError(f"an action kind's code is upper-case letters and _, got {spec.code!r}")
    if spec.cost is not None and spec.cost not in COST_FIELDS:
        raise ValueError(f"cost of kind {spec.code} must be one of {COST_FIELDS} or None")
    # Enum has no public way to add a member; this is how Flag makes its
    # pseudo-members: an instance looked up by value like any member.
    member = str.__new__(Kind, spec.code)
    member._name_ = spec.code
    member._value_ = spec.code
    Kind._value2member_map_[spec.code] = member
    _TABLE[spec.code] = spec
    return member


def unregister_kind(kind: Kind) -> None:
    """Remove a kind that :func:`register_kind` added.

    Raises:
        ValueError: for a built-in kind.
    """
    if kind.value in _BUILT_IN:
        raise ValueError(f"kind {kind.value} is built in and cannot be removed")
    _TABLE.pop(kind.value, None)
    Kind._value2member_map_.pop(kind.value, None)
