"""When a stage's gathered weights may be freed within a step (``shard_parameters=True``).

A stage's full weights are read by its forwards (``F``) and by its input
passes (``I``: ``dX = dY W``, or ``B``, which is ``I`` and ``W`` at once), but
never by a weight pass alone (``W``: ``dW = dY^T X`` reads what ``I``
stashed). So under 2BP a stage frees its gathered weights right after its
last ``I`` of the step, before its ``W`` run: the deferred weight passes of a
step run on the shard alone. A ``W`` that rebuilds its stash (a ``WR``, or
every ``W`` under ``recompute="derivatives"`` or ``"all"``) runs the forward
again and reads the weights: the stage keeps them until that ``W``. A residency
whose ``free_before_w`` is False keeps each stage's weights until its last compute
action instead (its last ``W``), as a sharding that frees after the backward does:
what the step would hold without 2BP's saving, measured rather than counted.

:func:`last_weight_reads` reads this off the rank's actions (pure: no torch);
:class:`Residency` is what the step runner calls around the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from twobp.schedule.action import Action, Kind
from twobp.schedule.gradient_scatter import MAKES_GRADIENTS

READS_WEIGHTS = frozenset(
    {
        Kind.FORWARD,
        Kind.FULL_BACKWARD,
        Kind.BACKWARD_INPUT,
        Kind.BACKWARD_INPUT_REBUILT,
        Kind.BACKWARD_WEIGHT_REBUILD,
    }
)
"""The kinds whose compute reads the stage's full weights."""


def last_weight_reads(
    actions: Sequence[Action], rebuilds_at_weight: Callable[[int], bool] = lambda _: False
) -> dict[int, int]:
    """The index in ``actions`` of each stage's last action that reads its full weights.

    Args:
        actions: one rank's actions of a step, in order.
        rebuilds_at_weight: ``rebuilds_at_weight(stage)`` is True if every ``W`` of
            ``stage`` runs its forward again (``recompute="derivatives"`` or ``"all"``).

    Returns:
        ``{stage: index}``, for every stage with such an action.

    Example::

        >>> acts = [Action.parse(a) for a in ("0F0", "0I0", "0W0")]
        >>> last_weight_reads(acts)
        {0: 1}
    """
    last: dict[int, int] = {}
    for index, action in enumerate(actions):
        reads = action.kind in READS_WEIGHTS or (
            action.kind is Kind.BACKWARD_WEIGHT and rebuilds_at_weight(action.stage)
        )
        if reads:
            last[action.stage] = index
    return last


def last_uses(actions: Sequence[Action]) -> dict[int, int]:
    """The index in ``actions`` of each stage's last compute action (its last ``W`` or ``B``):
    where the stage would free its weights if it kept them through its weight passes."""
    return {a.stage: i for i, a in enumerate(actions) if a.kind.is_compute}


class Residency(Protocol):
    """What holds a rank's sharded weights, as the step runner drives it."""

    free_before_w: bool
    """True: free a stage's weights after its last read of them (its last ``I``);
    False: only after its last compute action (its last ``W``)."""

    scatter_each_w: bool | None
    """Reduce-scatter a stage's whole gradients only at its ``R`` (False), after each of
    its ``W`` or ``B`` (True), or after each where that can lower the peak (None, see
    :func:`twobp.schedule.gradient_scatter.scattered_each_w`)."""

    def gather_for_step(self) -> None:
        """Start gathering every stage's weights, in the order of the stages' first ``F``."""
        ...

    def scattered(self, nbytes: int) -> None:
        """The action just run started reduce-scatters of ``nbytes`` of whole gradients
        (counted as held at its end, by the next :meth:`observe`)."""
        ...

    def wait(self, stage: int | None = None) -> None:
        """Wait for the gathers ``stage``'s forward needs (None: all)."""
        ...

    def release(self, stage: int) -> None:
        """``stage`` has read its weights for the last time in this step: free them
        (once no other stage of this rank that reads them still will)."""
        ...

    def in_flight(self, nbytes: int) -> None:
        """After an action: ``nbytes`` of whole gradients are held by reduce-scatters not
        yet complete (timing-dependent; not counted by :meth:`observe`)."""
        ...

    def observe(
        self, between: int, read: frozenset[int], used: frozenset[int], during: bool = False
    ) -> None:
        """After a compute action: ``between`` bytes of activations and stashes held now,
        the stages past their last read of their weights (``read``) and those past their
        last compute action (``used``) in the step. The whole gradients held now are
        counted too: those of the parameters, and those a reduce-scatter started by the
        action copied (:meth:`scattered`)."""
        ...

    def release_all(self) -> None:
        """Free every gathered weight (the step ended, or failed part-way)."""
        ...


class StepResidency:
    """One step's calls of a :class:`Residency` as the rank's actions run.

    Args:
        residency: what holds the rank's sharded weights.
        actions: the rank's actions of the step, in order.
        rebuilds_at_weight: as for :func:`last_weight_reads`.
    """

    def __init__(
        self,
        residency: Residency,
        actions: Sequence[Action],
        rebuilds_at_weight: Callable[[int], bool],
    ) -> None:
        self._residency = residency
        self._last_reads = last_weight_reads(actions, rebuilds_at_weight)
        self._last_uses = last_uses(actions)
        self._release_at = self._last_reads if residency.free_before_w else self._last_uses
        self._read: set[int] = set()
        self._used: set[int] = set()

    def after(self, index: int, action: Action, between: int, before: int = 0) -> None:
        """Action ``index`` of the step ran; ``between`` bytes of activations and stashes
        are held now, ``before`` were before it ran. Frees its stage's weights after their
        last read (or, with ``free_before_w`` False, after their last compute action).

        An action that makes weight gradients (``W``, ``B``) holds them while what it
        frees at its end (``B``'s activations, ``W``'s stash) is still held: that moment
        is observed too, with ``before``, the weights it read still gathered."""
        stage = action.stage
        if action.kind in MAKES_GRADIENTS:
            read, used = frozenset(self._read), frozenset(self._used)
            self._residency.observe(before, read, used, during=True)
        if self._last_reads.get(stage) == index:
            self._read.add(stage)
        if self._last_uses.get(stage) == index:
            self._used.add(stage)
        if self._release_at.get(stage) == index:
            self._residency.release(stage)
        if action.kind.is_compute:
            self._residency.observe(between, frozenset(self._read), frozenset(self._used))
