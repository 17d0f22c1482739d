"""Recompute modes: what a stage keeps between its passes, and what that costs (no torch).

A stage may trade compute for memory in two places:

* ``"activations"``: from ``F`` until ``I`` (or ``B``) the stage keeps only its
  inputs; its forward runs again at the start of ``I``, so ``I`` takes
  ``F + I`` and ``W`` still finds what it needs.
* ``"derivatives"`` (derivative checkpointing): from ``I`` until ``W`` the stage
  keeps only its inputs and the gradients of its outputs; ``W`` rebuilds the
  stash by running the forward and the input pass again, so ``W`` of ``n``
  micro-batches takes ``n * (F + I)`` more. ``W`` rebuilds one group of
  ``weight_group_size`` micro-batches at a time, which it holds while it runs.
  A stage that runs only ``B`` keeps no stash: the mode changes nothing there.
* ``"all"``: both.

:func:`parse_recompute` reads the ``Pipeline(recompute=...)`` option;
:func:`with_recompute` turns a cost model into the cost model of the same
stages run with recomputation, which the simulator, its memory model and the
planner read like any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from twobp.sim.costs import CostModel, PerStage

RECOMPUTE_MODES = ("activations", "derivatives", "all")
"""The recompute modes; None (in the planner: ``"off"``) recomputes nothing."""

NO_RECOMPUTE = "off"
"""The planner's name of no recomputation (``recompute=None``)."""

RECOMPUTE_AUTO = "auto"
"""Rebuild only the stashes that do not fit a memory limit, chosen per stage and
micro-batch (:func:`twobp.sim.rebuild.fewest_rebuilds`); the schedule then says which
(its ``IR`` and ``WR`` actions), not a mode per stage."""

Mode = str | None


def recomputes_activations(mode: Mode) -> bool:
    """True if ``mode`` runs the forward again at the start of ``I`` (or ``B``)."""
    return mode in ("activations", "all")


def recomputes_derivatives(mode: Mode) -> bool:
    """True if ``mode`` rebuilds the stash of ``W`` from the inputs and output gradients."""
    return mode in ("derivatives", "all")


def _one(value: object, where: str) -> Mode:
    if value is None or value == NO_RECOMPUTE:
        return None
    if isinstance(value, str) and value in RECOMPUTE_MODES:
        return value
    choices = ", ".join(["None", *map(repr, RECOMPUTE_MODES)])
    raise ValueError(
        f"recompute={value!r}{where}: unknown mode; choose one of {choices}, "
        "or a list with one of them per stage"
    )


def parse_recompute(value: object, n_stages: int) -> tuple[Mode, ...]:
    """The recompute mode of every stage.

    Args:
        value: None, a mode of :data:`RECOMPUTE_MODES` (every stage), or a
            list or tuple with one mode (or None) per stage.
        n_stages: stages of the pipeline.

    Returns:
        One mode (or None) per stage.

    Raises:
        ValueError: on an unknown mode, or a list of another length than
            ``n_stages``; the message names the option and the choices.
    """
    if isinstance(value, (list, tuple)):
        if len(value) != n_stages:
            raise ValueError(
                f"recompute={list(value)!r}: {len(value)} entries for {n_stages} stages; "
                "give one mode (or None) per stage, or one mode for all"
            )
        return tuple(_one(v, f" (stage {s})") for s, v in enumerate(value))
    return (_one(value, ""),) * n_stages


def effective_modes(modes: Sequence[Mode], split: Iterable[int]) -> tuple[Mode, ...]:
    """What each stage actually recomputes: derivatives only on stages that run ``I`` and ``W``.

    Args:
        modes: the mode of every stage.
        split: the stages that run ``I`` and ``W`` (the others run ``B``).
    """
    splits = set(split)
    out: list[Mode] = []
    for s, mode in enumerate(modes):
        if s not in splits and recomputes_derivatives(mode):
            mode = "activations" if recomputes_activations(mode) else None
        out.append(mode)
    return tuple(out)


def input_bytes(costs: CostModel, stage: int) -> float:
    """Bytes of one micro-batch's input to ``stage``: what crosses the boundary before it.

    Stage 0 reads the model's input, which the cost model does not know; it
    is taken to be as large as what stage 0 sends on.
    """
    assert costs.send_bytes is not None
    return costs.send_bytes[stage - 1] if stage > 0 else costs.send_bytes[0]


def with_recompute(
    costs: CostModel,
    modes: Mode | Sequence[Mode],
    weight_group_size: int | None = None,
) -> CostModel:
    """The cost model of the same stages run with recomputation and a cap on W groups.

    Per stage and micro-batch, ``"activations"`` holds the stage input
    (:func:`input_bytes`) from ``F`` until ``I`` instead of its activations,
    and makes ``I`` and ``B`` longer by ``F``; ``"derivatives"`` holds the
    input and the output gradient (the bytes sent across the stage's
    boundary) from ``I`` until ``W`` instead of the stash, makes ``W`` longer
    by ``F + I`` per micro-batch, and has ``W`` hold the stash of one group
    while it runs (``weight_rebuild_bytes``).

    Args:
        costs: the cost model of the stages without recomputation.
        modes: one mode for every stage, or one per stage.
        weight_group_size: the most micro-batches one ``W`` concatenates (and,
            with ``"derivatives"``, rebuilds) at once; None: no cap.

    Returns:
        The new cost model (``costs`` itself when nothing changes).

    Raises:
        ValueError: on an unknown mode or a list of another length, or
            ``weight_group_size < 1``.
    """
    n = costs.n_stages
    per_stage = parse_recompute(list(modes) if isinstance(modes, (list, tuple)) else modes, n)
    if weight_group_size is not None and weight_group_size < 1:
        raise ValueError(f"weight_group_size must be None or >= 1, got {weight_group_size}")
    if all(m is None for m in per_stage) and weight_group_size is None:
        return costs
    assert costs.activation_bytes is not None and costs.weight_grad_bytes is not None
    assert costs.backward_full is not None and costs.send_bytes is not None
    forward = costs.forward
    backward_input = list(costs.backward_input)
    backward_full = list(costs.backward_full)
    backward_weight = list(costs.backward_weight)
    activation = list(costs.activation_bytes)
    stash = list(costs.weight_grad_bytes)
    rebuild = list(costs.weight_rebuild_bytes or (0.0,) * n)
    concat = list(costs.weight_concat or (None,) * n)
    for s, mode in enumerate(per_stage):
        if recomputes_derivatives(mode):
            extra = forward[s] + costs.backward_input[s]
            backward_weight[s] += extra
            table = concat[s]
            if table is not None:
                concat[s] = {k: t + k * extra for k, t in table.items()}
            rebuild[s] += stash[s]
            stash[s] = input_bytes(costs, s) + costs.send_bytes[s]
        if recomputes_activations(mode):
            backward_input[s] += forward[s]
            backward_full[s] += forward[s]
            activation[s] = input_bytes(costs, s)

    def per(values: Sequence[float]) -> PerStage:
        return tuple(values)

    return replace(
        costs,
        backward_input=per(backward_input),
        backward_full=per(backward_full),
        backward_weight=per(backward_weight),
        weight_concat=None if costs.weight_concat is None else tuple(concat),
        activation_bytes=per(activation),
        weight_grad_bytes=per(stash),
        weight_rebuild_bytes=per(rebuild),
        weight_group_size=weight_group_size
        if weight_group_size is not None
        else costs.weight_group_size,
    )
