"""Every rank's share of a few training steps against the same steps in one process.

The tests of a model on gloo ranks each have the ranks return, per step, the
step's loss and their own stages' gradients, and at the end their parameters;
the reference is plain PyTorch on the whole model. :func:`assert_equal_to_one_process`
joins the ranks' shares and compares them with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def joined(results: Sequence[Mapping[str, Any]], key: str) -> dict[str, Tensor]:
    """The union of every rank's ``results[rank][key]`` (each names its own tensors)."""
    out: dict[str, Tensor] = {}
    for r in results:
        out.update(r[key])
    return out


def assert_equal_to_one_process(
    results: Sequence[Mapping[str, Any]],
    reference: tuple[list[float], list[dict[str, Tensor]], dict[str, Tensor]],
    tol: float,
    *,
    state_key: str = "state",
    every_state_entry: bool = False,
    grads_close: Callable[[dict[str, Tensor], dict[str, Tensor]], None] | None = None,
) -> None:
    """Every rank's losses, the ranks' gradients of every step and their final
    parameters (``results[rank][state_key]``) equal the reference's within ``tol``.

    Args:
        results: per rank, ``{"losses": [...], "grads": [{name: grad}, ...], state_key: {...}}``.
        reference: the losses, each step's gradients and the final state of one process.
        tol: the absolute tolerance.
        state_key: where the ranks put their final parameters.
        every_state_entry: the ranks' state holds exactly the reference's names (else
            at least them).
        grads_close: compares one step's gradients (default: each within ``tol``, the
            same names).
    """
    want_losses, want_grads, want_state = reference
    for rank, r in enumerate(results):
        for got, want in zip(r["losses"], want_losses, strict=True):
            assert math.isclose(got, want, rel_tol=0, abs_tol=tol), (rank, got, want)
    for step, want_step in enumerate(want_grads):
        grads = joined([{"grads": r["grads"][step]} for r in results], "grads")
        if grads_close is not None:
            grads_close(grads, want_step)
            continue
        assert set(grads) == set(want_step)
        for name, want in want_step.items():
            torch.testing.assert_close(grads[name], want, rtol=0, atol=tol, msg=name)
    state = joined(results, state_key)
    if every_state_entry:
        assert set(state) == set(want_state)
    for name, want in want_state.items():
        torch.testing.assert_close(state[name], want, rtol=0, atol=tol, msg=name)
