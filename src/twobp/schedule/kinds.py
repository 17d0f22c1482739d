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
* ``role``: what it is to its rank (a :class:`Role`): compute, a send or a
  receive between ranks, or work in the background;
* ``link``: for a send or receive, the stage at the other end (its offset);
* ``cost``: the field of ``twobp.sim.CostModel`` that holds its time
  (``None``: it takes no time);
* ``memory``: what it takes and gives back, per micro-batch it covers, as
  :class:`MemoryChange` entries: a pool of memory (the ``CostModel`` field of
  its bytes per micro-batch on the stage), ``+1`` or ``-1``, at its start or
  its end;
* ``label`` and ``colour``: how legends and pictures show it.

The table, with ``S`` stages, ``s`` a stage, ``m`` a micro-batch::

    kind    role        needs                            makes    cost
    F       compute     F(s-1, m) via RECV_F             F        forward
    I       compute     F(s, m), BI(s+1, m) via RECV_B   BI       backward_input
    W       compute     BI(s, m) for each m covered      W        backward_weight
    B       compute     as I                             BI, W    backward_full
    IR      compute     as I                             BI       backward_input
    WR      compute     BI(s, m) for each m covered      W        backward_weight (**)
    R       background  W(s, m) for each m covered       R        reduce
    SEND_F  send        F(s, m)                          SEND_F   -   (link s+1)
    RECV_F  receive     SEND_F(s-1, m)                   RECV_F   -   (link s-1)
    SEND_B  send        BI(s, m)                         SEND_B   -   (link s-1)
    RECV_B  receive     SEND_B(s+1, m)                   RECV_B   -   (link s+1)

and its memory, per micro-batch covered (the pools are named by their
``CostModel`` fields; a transfer and ``R`` hold nothing)::

    kind    at its start                   at its end
    F       + activation_bytes
    I                                      - activation_bytes, + weight_grad_bytes
    W       + weight_rebuild_bytes (*)     - weight_rebuild_bytes (*), - weight_grad_bytes
    B                                      - activation_bytes
    IR                                     - activation_bytes, + checkpoint_bytes
    WR      + weight_grad_bytes (*)        - weight_grad_bytes (*), - checkpoint_bytes

    (*) for at most ``weight_group_size`` micro-batches: the engine
        rebuilds one concatenated group at a time.
    (**) plus ``forward + backward_input`` per micro-batch: the rebuild.

``IR`` and ``WR`` are the ``I`` and ``W`` of a micro-batch whose stash is
rebuilt instead of kept (derivative checkpointing of that one micro-batch,
``recompute="auto"``): ``IR`` keeps only the stage's inputs and output
gradients (``checkpoint_bytes``), and ``WR`` runs the forward and the input
pass again to rebuild the stash, holding it while it runs. A schedule says
which micro-batches are rebuilt by these kinds, so the choice shows in its
text (``1IR3``, ``1WR3``) and every reader of the table sees it.

So a micro-batch holds its activations from its ``F`` to its ``I`` (or
``B``), then what its ``W`` needs (the stored derivatives) until that ``W``.
The simulator's memory model, the memory bound of the 2BP ``fill`` policy
and the micro-batches a rank holds are read from these entries
(:func:`pool_change`, :func:`held_change`).

``R`` reduces a stage's weight gradients over the ranks that hold a replica
of it (data parallel, Chimera's two pipelines, weights tied across stages):
it covers every micro-batch of the stage, so it starts once the stage's last
``W`` (or ``B``) is done, and runs *in the background*: its rank goes on at
once while the all-reduce proceeds.

``BI`` is the gradient with respect to a stage's input. A new kind is one
entry: :func:`declare_kind` checks it and returns a :class:`DeclaredKind`
that carries it, so actions of that kind validate, simulate (their time and
their memory) and draw, and parse where the kind is passed to
:meth:`~twobp.schedule.Action.parse`; the runtime needs a handler for it too.
Declaring changes nothing shared: neither :class:`Kind` nor :data:`KINDS`,
which hold the built-in kinds. This module imports no torch.
"""

from __future__ import annotations

import functools
import re
import warnings
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
    BACKWARD_INPUT_REBUILT = "IR"
    """Backward-p1 that keeps no stash for W, only the inputs and output gradients."""
    BACKWARD_WEIGHT_REBUILD = "WR"
    """Backward-p2 that first rebuilds the stash an ``IR`` dropped."""
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
        """True for F, B, I, W, R; False for transfers."""
        return _compute_kind(self)

    @property
    def role(self) -> Role:
        """What the kind is to its rank (from the table)."""
        return kind_spec(self).role

    def __str__(self) -> str:
        return self.value


class Role(str, Enum):
    """What an action of a kind is to the rank that runs it."""

    COMPUTE = "compute"
    """Work that holds its rank for its time (F, I, W, B)."""
    SEND = "send"
    """Hands a result of this rank to the stage at ``link`` on another rank."""
    RECEIVE = "receive"
    """Takes a result from the stage at ``link`` on another rank."""
    BACKGROUND = "background"
    """Runs beside its rank's compute (an asynchronous collective, R): the rank
    goes on at once, and its result is there ``cost`` later."""


class Moment(str, Enum):
    """When, in an action's run, a change of memory happens."""

    START = "start"
    END = "end"


COST_FIELDS = ("forward", "backward_input", "backward_weight", "backward_full", "reduce")
"""The times per stage of ``twobp.sim.CostModel`` that a kind may take."""

ACTIVATIONS = "activation_bytes"
"""The pool of a micro-batch's activations, from its forward to its input gradient."""
STORED_DERIVATIVES = "weight_grad_bytes"
"""The pool of what a micro-batch's weight pass needs, from its ``I`` to its ``W``."""
REBUILT_STASH = "weight_rebuild_bytes"
"""The pool of what a ``W`` rebuilds and holds while it runs (derivative checkpointing)."""
CHECKPOINT = "checkpoint_bytes"
"""The pool of what an ``IR`` keeps for its ``WR`` instead of a stash: the stage's
inputs and output gradients."""
MEMORY_POOLS = (ACTIVATIONS, STORED_DERIVATIVES, REBUILT_STASH, CHECKPOINT)
"""The memory pools a kind may take or give back: fields of ``twobp.sim.CostModel``
holding bytes per micro-batch and stage."""

COUNT_CAPS = ("weight_group_size",)
"""The fields of ``twobp.sim.CostModel`` that may cap the micro-batches a change counts."""


@dataclass(frozen=True)
class MemoryChange:
    """What an action does to its rank's memory, for every micro-batch it covers.

    Args:
        pool: the memory, named by the ``CostModel`` field of its bytes per
            micro-batch on the stage (one of :data:`MEMORY_POOLS`).
        change: ``+1`` takes those bytes, ``-1`` gives them back.
        at: at the action's start or its end.
        cap: a ``CostModel`` field (one of :data:`COUNT_CAPS`) that caps the
            micro-batches counted, or ``None``: every micro-batch covered.
    """

    pool: str
    change: int
    at: Moment = Moment.END
    cap: str | None = None


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
        link: for a send or receive, the offset of the stage at the other
            end; ``None`` for the other roles.
        several: whether one action may cover several micro-batches.
        colour: its colour in pictures, or ``None`` for a neutral one.
        role: what it is to its rank; a send or receive has a ``link``, no
            other role has one.
        memory: what it takes and gives back, per micro-batch it covers
            (nothing by default).
    """

    code: str
    label: str
    needs: tuple[Need, ...] = ()
    makes: tuple[str, ...] = ()
    cost: str | None = None
    link: int | None = None
    several: bool = False
    colour: str | None = None
    role: Role = Role.COMPUTE
    memory: tuple[MemoryChange, ...] = ()

    @property
    def is_compute(self) -> bool:
        """True unless the kind is a transfer between ranks (a send or a receive)."""
        return self.role not in (Role.SEND, Role.RECEIVE)

    @property
    def background(self) -> bool:
        """True if the kind runs beside its rank's compute (:attr:`Role.BACKGROUND`)."""
        return self.role is Role.BACKGROUND


_BACKWARD_NEEDS = (Need("F"), Need("BI", +1, via="RECV_B"))
_SEND, _RECEIVE, _BACKGROUND = Role.SEND, Role.RECEIVE, Role.BACKGROUND

# Colour-blind-safe (Okabe-Ito) colours for the compute kinds.
_TABLE: dict[str, KindSpec] = {
    spec.code: spec
    for spec in (
        KindSpec(
            "F",
            "forward",
            (Need("F", -1, via="RECV_F"),),
            ("F",),
            "forward",
            colour="#56B4E9",
            memory=(MemoryChange(ACTIVATIONS, +1, Moment.START),),
        ),
        KindSpec(
            "I",
            "backward-p1 (I)",
            _BACKWARD_NEEDS,
            ("BI",),
            "backward_input",
            colour="#E69F00",
            memory=(MemoryChange(ACTIVATIONS, -1), MemoryChange(STORED_DERIVATIVES, +1)),
        ),
        KindSpec(
            "W",
            "backward-p2 (W)",
            (Need("BI"),),
            ("W",),
            "backward_weight",
            several=True,
            colour="#009E73",
            memory=(
                MemoryChange(REBUILT_STASH, +1, Moment.START, cap="weight_group_size"),
                MemoryChange(REBUILT_STASH, -1, cap="weight_group_size"),
                MemoryChange(STORED_DERIVATIVES, -1),
            ),
        ),
        KindSpec(
            "B",
            "backward",
            _BACKWARD_NEEDS,
            ("BI", "W"),
            "backward_full",
            colour="#CC79A7",
            memory=(MemoryChange(ACTIVATIONS, -1),),
        ),
        KindSpec(
            "IR",
            "backward-p1, stash rebuilt (IR)",
            _BACKWARD_NEEDS,
            ("BI",),
            "backward_input",
            colour="#F0E442",
            memory=(MemoryChange(ACTIVATIONS, -1), MemoryChange(CHECKPOINT, +1)),
        ),
        KindSpec(
            "WR",
            "backward-p2, rebuilding (WR)",
            (Need("BI"),),
            ("W",),
            "backward_weight",
            several=True,
            colour="#0072B2",
            memory=(
                MemoryChange(STORED_DERIVATIVES, +1, Moment.START, cap="weight_group_size"),
                MemoryChange(STORED_DERIVATIVES, -1, cap="weight_group_size"),
                MemoryChange(CHECKPOINT, -1),
            ),
        ),
        KindSpec(
            "R",
            "gradient reduction (R)",
            (Need("W"),),
            ("R",),
            "reduce",
            several=True,
            colour="#D55E00",
            role=_BACKGROUND,
        ),
        KindSpec("SEND_F", "send_f", (Need("F"),), ("SEND_F",), link=+1, role=_SEND),
        KindSpec("RECV_F", "recv_f", (Need("SEND_F", -1),), ("RECV_F",), link=-1, role=_RECEIVE),
        KindSpec("SEND_B", "send_b", (Need("BI"),), ("SEND_B",), link=-1, role=_SEND),
        KindSpec("RECV_B", "recv_b", (Need("SEND_B", +1),), ("RECV_B",), link=+1, role=_RECEIVE),
    )
}

KINDS: Mapping[str, KindSpec] = MappingProxyType(_TABLE)
"""Every built-in kind by its code, in table order."""

_CODE = re.compile(r"[A-Z][A-Z_]*")


@dataclass(frozen=True)
class DeclaredKind:
    """A kind of action beyond the built-in :class:`Kind`, carrying its own table entry.

    Made by :func:`declare_kind`. It answers what an action's kind is asked
    (:attr:`value`, :attr:`role`, :attr:`is_compute`, its text), and
    :func:`kind_spec` reads its entry from it, so nothing else needs to know it.

    Args:
        spec: its entry, checked by :func:`declare_kind`.
    """

    spec: KindSpec

    @property
    def value(self) -> str:
        """The kind's text in an action (``X`` in ``1X0``)."""
        return self.spec.code

    @property
    def is_compute(self) -> bool:
        """True: a declared kind is never a transfer between ranks."""
        return self.spec.is_compute

    @property
    def role(self) -> Role:
        """What the kind is to its rank (from its entry)."""
        return self.spec.role

    def __str__(self) -> str:
        return self.spec.code


ActionKind = Kind | DeclaredKind
"""What an action does: a built-in :class:`Kind` or a :class:`DeclaredKind`."""


@functools.cache
def _compute_kind(kind: Kind) -> bool:
    """:attr:`Kind.is_compute`, kept: a built-in kind's entry never changes."""
    return kind_spec(kind).is_compute


def kind_spec(kind: ActionKind | str) -> KindSpec:
    """The table entry of ``kind`` (a :class:`Kind`, its code, or a :class:`DeclaredKind`).

    Raises:
        ValueError: if no built-in kind has that code.
    """
    if isinstance(kind, DeclaredKind):
        return kind.spec
    # A Kind is a str enum: it finds its own code's entry (the walks ask millions of times).
    spec = _TABLE.get(kind)
    if spec is None:
        code = kind.value if isinstance(kind, Kind) else kind
        raise ValueError(f"unknown action kind {code!r}; kinds are {', '.join(_TABLE)}")
    return spec


def pool_change(kind: ActionKind | str, pool: str) -> int:
    """How one action of ``kind`` changes what ``pool`` holds, per micro-batch it covers.

    Start and end together: ``F`` takes activations (+1), ``I`` and ``B``
    give them back (-1), a ``W`` gives back the stored derivatives (-1), and
    what an action holds only while it runs counts 0.

    Raises:
        ValueError: if no kind has that code.
    """
    return sum(e.change for e in kind_spec(kind).memory if e.pool == pool)


def held_change(kind: ActionKind | str) -> int:
    """How one action of ``kind`` changes the micro-batches its rank holds, per micro-batch.

    A micro-batch is held while some pool holds memory of it: from its ``F``
    (+1) through its ``I`` (0: activations become stored derivatives) to its
    ``W`` or ``B`` (-1).

    Raises:
        ValueError: if no kind has that code.
    """
    return sum(pool_change(kind, pool) for pool in MEMORY_POOLS)


def held_pools() -> tuple[str, ...]:
    """The pools that hold memory between actions: one built-in kind takes them, another
    gives them back.

    The activations and the stored derivatives; what an action holds only
    while it runs (a rebuilt stash) is not among them.
    """
    return tuple(p for p in MEMORY_POOLS if any(pool_change(k, p) for k in _TABLE))


def declare_kind(spec: KindSpec) -> DeclaredKind:
    """A new kind of action, checked: compute or background work that the table lacks.

    Validation, the walker, the simulators (its time and its memory), the
    cost model and the pictures read its entry from the kind itself, so the
    new kind needs nothing else there; :meth:`twobp.schedule.Action.parse`
    reads its text where it is passed the kind. The runtime does not run it
    without a handler. Nothing shared changes: :class:`Kind` and
    :data:`KINDS` keep the built-in kinds.

    Args:
        spec: the new kind's entry.

    Returns:
        The kind, to build actions with (``Action(stage, kind, microbatches)``).

    Raises:
        ValueError: if the code is a built-in kind's or malformed, ``cost`` is
            not one of :data:`COST_FIELDS`, the ``role`` and ``link`` disagree
            (a send or receive has a link, nothing else has one), the kind is
            a send or receive (the transfers between ranks are the built-in
            ones), or a memory entry names another pool than
            :data:`MEMORY_POOLS`, a change other than ``+1``/``-1`` or a cap
            other than :data:`COUNT_CAPS`.
    """
    if spec.code in _TABLE:
        raise ValueError(f"action kind {spec.code!r} exists already")
    if not _CODE.fullmatch(spec.code):
        raise ValueError(f"an action kind's code is upper-case letters and _, got {spec.code!r}")
    if spec.cost is not None and spec.cost not in COST_FIELDS:
        raise ValueError(f"cost of kind {spec.code} must be one of {COST_FIELDS} or None")
    if (spec.link is None) != spec.is_compute:
        raise ValueError(
            f"kind {spec.code} has role {spec.role.value} and link {spec.link}: a send or "
            "receive needs the offset of the stage at its other end, no other role has one"
        )
    if not spec.is_compute:
        transfers = ", ".join(code for code, s in _TABLE.items() if not s.is_compute)
        raise ValueError(
            f"kind {spec.code} has role {spec.role.value}: a declared kind is compute or "
            f"background work; the transfers between ranks are the built-in {transfers}"
        )
    for entry in spec.memory:
        if entry.pool not in MEMORY_POOLS:
            raise ValueError(f"memory of kind {spec.code}: pool must be one of {MEMORY_POOLS}")
        if entry.change not in (-1, +1):
            raise ValueError(f"memory of kind {spec.code}: change must be +1 or -1")
        if entry.cap is not None and entry.cap not in COUNT_CAPS:
            raise ValueError(f"memory of kind {spec.code}: cap must be one of {COUNT_CAPS}")
    return DeclaredKind(spec)


def register_kind(spec: KindSpec) -> DeclaredKind:
    """:func:`declare_kind`, under the name it had when it added to :class:`Kind`.

    It adds nothing any more: ``Kind(spec.code)`` and ``Action.parse`` without
    the kind do not know it.

    Raises:
        ValueError: as :func:`declare_kind`.
    """
    warnings.warn(
        "register_kind no longer adds to Kind or KINDS: call declare_kind(spec) and build "
        "actions with the kind it returns (Action.parse(text, kinds=[kind]) for text)",
        DeprecationWarning,
        stacklevel=2,
    )
    return declare_kind(spec)
