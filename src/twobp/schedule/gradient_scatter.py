"""Where a sharded stage's whole gradients are reduce-scattered into its shard.

With sharded parameters (``Pipeline(shard_parameters=True)``) each ``W`` (or
``B``) of a stage adds to the stage's *whole* weight gradients, and a
reduce-scatter over the stage's copies turns them into this rank's shard of
their sum. Where that happens is one of two choices, per stage:

* **at R** (the default): once, at the stage's ``R`` (right after its last
  ``W``): the whole gradients are held from the stage's first ``W`` to its ``R``;
* **after each W**: after every ``W`` (and ``WR``, and fused ``B``) the schedule
  lists for the stage, the gradients it made are reduce-scattered and added to
  the shard, and the whole gradients freed: they are held only while a ``W``
  runs and while its reduce-scatter is in flight. The last one replaces
  ``R``'s. A stage of ``m`` listed ``W`` then sends ``m`` times the bytes.

The second can lower a rank's peak only where the first would hold the whole
gradients across work that takes memory: some compute action of the rank other
than a ``W`` of the stage lies between the stage's first and last ``W`` (an
``F`` or ``I`` in the steady state, as ``zb-h1`` and 2BP's ``eager`` placements
run, or another stage's ``W``, whose gradients would be held at the same time).
Where every ``W`` of a stage runs back to back (1f1b with every ``W`` after the
last ``I``), both hold the gradients at the first ``W`` with every stash, and one
reduce-scatter is cheaper. Where the link is slower than the ``W`` come, the
reduce-scatters in flight pile up and hold more than one reduce-scatter at ``R``
would: the simulator says which (``CostModel.scatter_each_w``), so it is asked for
(``setting=True``), or left to this rule (``setting=None``), not the default.

A ``W`` listed in the schedule is at the same position on every data-parallel
copy of the stage, so the reduce-scatters pair up. A schedule of two pipelines
(Chimera, DualPipe) holds a model stage on two ranks with their own action
lists, which may concatenate its ``W`` differently (Chimera on 2 ranks: one
``W`` over two micro-batches on one, one per micro-batch on the other): there a
model stage reduce-scatters after each ``W`` only where every holder lists as
many, and otherwise at ``R`` on all of them (:func:`scattered_each_w_by_rank`).
Under the ``dynamic`` 2BP policy a wait may run a ``W``'s parts before its
listed place, and the listed ``W`` then reduce-scatters whatever was made
since the last one (sums are linear, so each part is counted once). This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule

MAKES_GRADIENTS = frozenset(
    {Kind.BACKWARD_WEIGHT, Kind.BACKWARD_WEIGHT_REBUILD, Kind.FULL_BACKWARD}
)
"""The kinds that add to a stage's weight gradients: after each of them a stage that
scatters each ``W`` reduce-scatters its gradients (a fused ``B`` too)."""

SCATTERING = MAKES_GRADIENTS
"""The kinds after which a stage that scatters each ``W`` reduce-scatters its gradients."""


def lowers_peak(actions: Sequence[Action], stage: int) -> bool:
    """Whether scattering ``stage``'s gradients after each ``W`` can lower the peak of the
    rank that runs ``actions``: a compute action other than a ``W`` of ``stage`` (and
    other than an ``R``) lies between its first and last listed ``W``.

    Example::

        >>> acts = [Action.parse(a) for a in ("0F0", "0I0", "0W0", "0F1", "0I1", "0W1")]
        >>> lowers_peak(acts, 0), lowers_peak(acts[:2] + acts[3:5] + acts[2:3] + acts[5:], 0)
        (True, False)
    """
    at = [i for i, a in enumerate(actions) if a.stage == stage and a.kind in SCATTERING]
    if len(at) < 2:
        return False
    return any(
        a.kind.is_compute
        and a.kind is not Kind.REDUCE
        and not (a.stage == stage and a.kind in SCATTERING)
        for a in actions[at[0] : at[-1]]
    )


def scattered_each_w(actions: Sequence[Action], setting: bool | None) -> frozenset[int]:
    """The stages of one rank whose gradients are reduce-scattered after each listed ``W``.

    Args:
        actions: the rank's actions of a step, in order.
        setting: True: every stage with a ``W``; False: none (all at ``R``); None: the
            stages where it can lower the peak (:func:`lowers_peak`).
    """
    stages = {a.stage for a in actions if a.kind in SCATTERING}
    if setting is None:
        return frozenset(s for s in stages if lowers_peak(actions, s))
    return frozenset(stages) if setting else frozenset()


def scattered_each_w_by_rank(schedule: Schedule, setting: bool | None) -> dict[int, frozenset[int]]:
    """:func:`scattered_each_w` of every rank of ``schedule``, agreed among the holders of
    each model stage, so that their reduce-scatters pair up: a model stage whose holders
    list different numbers of ``W`` (and ``B``) for it reduce-scatters at ``R`` on all of
    them; one that some holder would scatter after each ``W`` does so on all.

    (A rank that holds a model stage twice, Chimera's middle stage on an odd number of
    ranks, reduce-scatters it at the ``R`` of the later one only: at ``R`` too.)
    """
    wanted = {r: scattered_each_w(acts, setting) for r, acts in schedule.actions.items()}
    if schedule.n_pipelines == 1:
        return wanted
    counts: dict[tuple[int, int], int] = {}
    for rank, acts in schedule.actions.items():
        for a in acts:
            if a.kind in SCATTERING:
                counts[rank, a.stage] = counts.get((rank, a.stage), 0) + 1
    agreed: set[int] = set()
    for model_stage in range(schedule.pipeline_stages):
        holders = [(r, s) for r, s in counts if schedule.model_stage(s) == model_stage]
        same = len({counts[h] for h in holders}) == 1 and len({r for r, _ in holders}) == len(
            holders
        )
        if same and any(s in wanted[r] for r, s in holders):
            agreed.add(model_stage)
    return {
        rank: frozenset(s for r, s in counts if r == rank and schedule.model_stage(s) in agreed)
        for rank in schedule.actions
    }


def scatter_points(actions: Sequence[Action], stages: frozenset[int]) -> dict[int, int]:
    """``{index: stage}``: the positions in ``actions`` after which ``stages`` reduce-scatter
    (each of their listed ``W`` and ``WR``)."""
    return {i: a.stage for i, a in enumerate(actions) if a.stage in stages and a.kind in SCATTERING}


def scatters_at_reduce(actions: Sequence[Action], stages: frozenset[int]) -> frozenset[int]:
    """The stages whose ``R`` still reduce-scatters their gradients: those not in ``stages``
    (scattered after each ``W``), and those whose last action that makes gradients before
    the ``R`` is a ``B``."""
    last: dict[int, Action] = {}
    out = set()
    for a in actions:
        if a.kind in MAKES_GRADIENTS:
            last[a.stage] = a
        elif a.kind is Kind.REDUCE:
            made = last.get(a.stage)
            if a.stage not in stages or made is None or made.kind not in SCATTERING:
                out.add(a.stage)
    return frozenset(out)
