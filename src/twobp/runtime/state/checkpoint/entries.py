"""What a checkpoint holds, as named tensors and JSON values, and back.

A checkpoint's tensors go to ``torch.distributed.checkpoint`` under flat names;
everything else goes to the manifest as JSON, so that loading a checkpoint
never unpickles an object:

==============================================  ==========================================
tensor name                                     what
==============================================  ==========================================
``model.<name>``                                a parameter or buffer (``model.3.attn.q.weight``)
``optimizer.state.<name>.<key>``                a tensor of a parameter's optimizer state
                                                (``optimizer.state.3.attn.q.weight.exp_avg``)
``rng.<pipeline rank>.<generator>``             a random generator's state (``torch``, ``cuda``,
                                                and the integers of ``python`` and ``numpy``)
==============================================  ==========================================

The JSON side holds the optimizer's param groups (hyper-parameters and the
names of their parameters) and the non-tensor values of its state, the rest
of each random generator's state, and the caller's ``extra``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.optimizer_and_rng import OptimizerState

MODEL = "model."
OPTIMIZER_STATE = "optimizer.state."
MASTER = "optimizer.master."
"""Checkpoint names of a sharded optimizer's float32 master weights (see :mod:`.shards`)."""
RNG = "rng."


def model_entries(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of a state dict, under ``model.<name>``."""
    return {MODEL + name: tensor for name, tensor in state_dict.items()}


# -- optimizer -------------------------------------------------------------------------


def optimizer_entries(state: OptimizerState) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An optimizer state by name (see :mod:`.optimizer_and_rng`) as tensors and JSON.

    Returns:
        ``{"optimizer.state.<name>.<key>": tensor}``, and the JSON part:
        ``{"param_groups": [...], "state": {name: {"tensors": [keys], "values": {...}}}}``.

    Raises:
        CheckpointError: if a hyper-parameter or a state value is neither a
            tensor nor JSON data.
    """
    tensors: dict[str, Tensor] = {}
    json_state: dict[str, Any] = {}
    for name, entries in state["state"].items():
        keys, values = [], {}
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"{OPTIMIZER_STATE}{name}.{key}"] = value
                keys.append(key)
            else:
                values[key] = check_json(value, f"the optimizer state {key!r} of {name}")
        json_state[name] = {"tensors": keys, "values": values}
    groups = [
        {
            key: _hyper_to_json(value, f"the optimizer's hyper-parameter {key!r}")
            for key, value in group.items()
        }
        for group in state["param_groups"]
    ]
    return tensors, {"param_groups": groups, "state": json_state}


def optimizer_tensor_names(saved: Mapping[str, Any], names: list[str]) -> list[str]:
    """The tensor names of the saved optimizer state of the parameters ``names``."""
    state = saved["state"]
    return [
        f"{OPTIMIZER_STATE}{name}.{key}" for name in names if name in state
        for key in state[name]["tensors"]
    ]  # fmt: skip


def optimizer_state(
    saved: Mapping[str, Any], tensors: Mapping[str, Tensor], names: list[str]
) -> OptimizerState:
    """The optimizer state by name of the parameters ``names``, from its JSON and tensors."""
    state: dict[str, Any] = {}
    for name in names:
        if name not in saved["state"]:
            continue
        entry = saved["state"][name]
        state[name] = {
            **entry["values"],
            **{key: tensors[f"{OPTIMIZER_STATE}{name}.{key}"] for key in entry["tensors"]},
        }
    groups = [
        {key: _hyper_from_json(value) for key, value in group.items()}
        for group in saved["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def merge_optimizer_json(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON optimizer parts of several ranks as one (each parameter is on one rank)."""
    merged: dict[str, Any] = {"param_groups": [], "state": {}}
    for part in parts:
        merged["param_groups"] += part["param_groups"]
        merged["state"].update(part["state"])
    return merged


def _hyper_to_json(value: Any, what: str) -> Any:
    # A hyper-parameter can be a tensor (a capturable or fused optimizer's lr).
    if isinstance(value, Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_hyper_to_json(v, what) for v in value]}
    return check_json(value, what)


def _hyper_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_hyper_from_json(v) for v in value["tuple"])
    return value


# -- random number generators ------------------------------------------------------------


def rng_entries(pp_rank: int, state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The states of :func:`.optimizer_and_rng.rng_state` as tensors and JSON.

    Returns:
        ``{"rng.<pp_rank>.<generator>": tensor}`` and the JSON rest of each state.
    """
    prefix = f"{RNG}{pp_rank}."
    tensors = {prefix + "torch": state["torch"]}
    if "cuda" in state:
        tensors[prefix + "cuda"] = state["cuda"].cpu()
    version, internal, gauss_next = state["python"]
    tensors[prefix + "python"] = torch.tensor(internal, dtype=torch.int64)
    rest: dict[str, Any] = {"python": {"version": version, "gauss_next": gauss_next}}
    if "numpy" in state:
        name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
        tensors[prefix + "numpy"] = torch.from_numpy(keys.astype("int64"))
        rest["numpy"] = {
            "name": name,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return tensors, rest


def rng_tensor_names(pp_rank: int, rest: Mapping[str, Any], cuda: bool) -> list[str]:
    """The tensor names of rank ``pp_rank``'s generator states."""
    prefix = f"{RNG}{pp_rank}."
    names = [prefix + "torch", prefix + "python"]
    names += [prefix + "numpy"] if "numpy" in rest else []
    return names + ([prefix + "cuda"] if cuda else [])


def rng_state_from_entries(
    pp_rank: int, tensors: Mapping[str, Tensor], rest: Mapping[str, Any]
) -> dict[str, Any]:
    """The states :func:`.optimizer_and_rng.set_rng_state` takes, from their entries."""
    prefix = f"{RNG}{pp_rank}."
    python = rest["python"]
    state: dict[str, Any] = {
        "torch": tensors[prefix + "torch"],
        "python": (
            python["version"],
            tuple(int(x) for x in tensors[prefix + "python"].tolist()),
            python["gauss_next"],
        ),
    }
    if prefix + "cuda" in tensors:
        state["cuda"] = tensors[prefix + "cuda"]
    if "numpy" in rest and importlib.util.find_spec("numpy") is not None:
        import numpy

        numpy_rest = rest["numpy"]
        keys = tensors[prefix + "numpy"].numpy().astype(numpy.uint32)
        state["numpy"] = (
            numpy_rest["name"],
            keys,
            numpy_rest["pos"],
            numpy_rest["has_gauss"],
            numpy_rest["cached_gaussian"],
        )
    return state


# -- JSON data --------------------------------------------------------------------------


def check_json(value: Any, what: str) -> Any:
    """``value`` if it is JSON data (tuples become lists); else an error naming ``what``.

    JSON data are dicts with string keys, lists, strings, numbers (NaN and
    infinities too), booleans and None.

    Raises:
        CheckpointError: naming where in ``value`` the first other object is.
    """
    return _json(value, what, "")


def _json(value: Any, what: str, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json(v, what, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise CheckpointError(
                    f"{what}{where} has the key {key!r}, not a string: a checkpoint keeps JSON "
                    "data only (dicts with string keys, lists, strings, numbers, booleans, None)"
                )
        return {k: _json(v, what, f"{where}[{k!r}]") for k, v in value.items()}
    raise CheckpointError(
        f"{what}{where} is a {type(value).__name__}: a checkpoint keeps JSON data only (dicts "
        "with string keys, lists, strings, numbers, booleans, None); store tensors in the "
        "model, or convert the value"
    )
