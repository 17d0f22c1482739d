"""The state a checkpoint keeps besides the weights: optimizer state by name, RNG states.

A torch optimizer numbers its parameters by position (``state[3]``), which
means nothing once the model is split another way. Here the state is keyed by
the parameter's name in the single-process model (``"4.attn.q.weight"``), so
a checkpoint written by one partition loads into another: each rank picks the
entries of the parameters it now holds, whichever rank wrote them.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from twobp.runtime.errors import CheckpointError

OptimizerState = dict[str, Any]
"""``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``."""


def _names_in_order(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str]:
    """The name of every parameter of ``optimizer``, in its own numbering."""
    ordered = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {list(p.shape)} that is not one "
                    "of this pipeline's: build it from pipe.parameters() (or a subset of them)"
                )
            ordered.append(names[id(p)])
    return ordered


def parameter_names(named: Iterable[tuple[str, nn.Parameter]]) -> dict[int, str]:
    """``id(parameter) -> name`` for ``named_parameters()``."""
    return {id(p): name for name, p in named}


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> OptimizerState:
    """The optimizer's state dict with parameters named instead of numbered.

    Args:
        optimizer: an optimizer over (some of) the pipeline's parameters.
        names: ``id(parameter) -> name`` (see :func:`parameter_names`).

    Returns:
        The state keyed by name, and the param groups with their hyper-parameters
        and the names of their parameters.

    Raises:
        CheckpointError: if the optimizer holds a parameter the pipeline does not.
    """
    ordered = _names_in_order(optimizer, names)
    state = optimizer.state_dict()
    return {
        "state": {ordered[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [ordered[i] for i in group["params"]],
            }
            for group in state["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    saved: Iterable[OptimizerState],
) -> None:
    """Load into ``optimizer`` the saved entries of the parameters it holds.

    Each param group takes the hyper-parameters of the saved group that held
    its first parameter; parameters without saved state start fresh (as
    they would before their first step).

    Args:
        optimizer: the optimizer to load into.
        names: ``id(parameter) -> name``.
        saved: the states of every rank file that holds one of its parameters.

    Raises:
        CheckpointError: if the optimizer holds a parameter of no saved group.
    """
    ordered = _names_in_order(optimizer, names)
    state_of: dict[str, Any] = {}
    group_of: dict[str, dict[str, Any]] = {}
    for part in saved:
        state_of.update(part["state"])
        for group in part["param_groups"]:
            for name in group["params"]:
                group_of[name] = group
    current = optimizer.state_dict()
    groups = []
    for group in current["param_groups"]:
        first = ordered[group["params"][0]] if group["params"] else None
        if first is not None and first not in group_of:
            raise CheckpointError(
                f"the checkpoint has no optimizer state for parameter {first}: it was saved "
                "with an optimizer over other parameters"
            )
        hyper = group_of[first] if first is not None else group
        groups.append(
            {**{k: v for k, v in hyper.items() if k != "params"}, "params": group["params"]}
        )
    state = {
        index: {k: _own(v) for k, v in state_of[name].items()}
        for index, name in enumerate(ordered)
        if name in state_of
    }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _own(value: Any) -> Any:
    # A tensor read with mmap=True still points into the file: copy it, so
    # that the optimizer's updates never depend on the file staying there.
    return value.clone() if isinstance(value, Tensor) else value


def rng_state(device: torch.device) -> dict[str, Any]:
    """The random number generator states of this process.

    Covers torch's CPU generator, the generator of ``device`` if it is a GPU,
    Python's ``random`` and, if installed, NumPy's global generator.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if importlib.util.find_spec("numpy") is not None:
        import numpy

        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restore the states :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
