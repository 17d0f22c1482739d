"""Cost models in files and on the command line.

JSON format (written by :func:`save_costs`, read by :func:`load_costs`; the
profiler of the runtime writes the same format)::

    {
      "format": "twobp-costs",
      "version": 1,
      "n_stages": 2,
      "forward":         [0.010, 0.012],        # seconds per micro-batch, per stage
      "backward_input":  [0.011, 0.013],
      "backward_weight": [0.009, 0.010],        # W of one micro-batch
      "backward_full":   [0.019, 0.022],        # optional (null: I + W of one)
      "forward_full":    [0.009, 0.011],        # optional: F of a fused stage (null: forward)
      "backward_weight_concat": [               # optional (null: linear in n)
        {"1": 0.009, "2": 0.016, "4": 0.030},   # stage 0: n micro-batches -> seconds
        {"1": 0.010, "4": 0.034}
      ],
      "send_latency": 2e-05,                    # seconds per transfer
      "send_overhead": 1e-04,                   # optional (default 0): seconds the
                                                # sender spends on each transfer
      "bandwidth": 2.5e10,                      # bytes/s; null: infinite
      "reduce_bandwidth": 1.5e9,                # optional (null: bandwidth): bytes/s
                                                # per rank of a ring all-reduce
      "send_bytes":        [4194304, 4194304],  # per micro-batch, boundary s -> s+1
      "activation_bytes":  [1.2e8, 1.2e8],      # per micro-batch, held F -> I/B
      "weight_grad_bytes": [6.0e7, 6.0e7],      # per micro-batch, held I -> W
      "parameter_bytes":   [1.4e9, 1.4e9],      # constant, per stage
      "optimizer_bytes":   [5.6e9, 5.6e9],      # optional: the optimizer state of a
                                                # stage, unsharded, held all the time
      "contention": 1.6,                        # optional (default 1.0): slowdown
                                                # while every rank computes at once
      "meta": {"model": "...", "device": "..."} # optional, free-form, kept as is
    }

Every list has one entry per stage. Only ``forward``, ``backward_input`` and
``backward_weight`` are required; other fields default as in
:class:`CostModel`.

The short text form of the command line (``F=1,I=1,W=1``) is read by
:func:`parse_costs`. This module imports no torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from twobp.sim.costs import CostModel, PerStage

COSTS_FORMAT = "twobp-costs"
COSTS_VERSION = 1


def costs_to_json(costs: CostModel) -> dict[str, Any]:
    """The JSON document of ``costs`` (format in the module docstring)."""
    concat = None
    if costs.weight_concat is not None:
        concat = [
            None if t is None else {str(n): v for n, v in sorted(t.items())}
            for t in costs.weight_concat
        ]
    return {
        "format": COSTS_FORMAT,
        "version": COSTS_VERSION,
        "n_stages": costs.n_stages,
        "forward": list(costs.forward),
        "forward_full": list(costs.forward_full or ()),
        "backward_input": list(costs.backward_input),
        "backward_weight": list(costs.backward_weight),
        "backward_full": list(costs.backward_full or ()),
        "backward_weight_concat": concat,
        "send_latency": costs.send_latency,
        "send_overhead": costs.send_overhead,
        "bandwidth": None if math.isinf(costs.bandwidth) else costs.bandwidth,
        "reduce_bandwidth": costs.reduce_bandwidth,
        "send_bytes": list(costs.send_bytes or ()),
        "activation_bytes": list(costs.activation_bytes or ()),
        "weight_grad_bytes": list(costs.weight_grad_bytes or ()),
        "parameter_bytes": list(costs.parameter_bytes or ()),
        "optimizer_bytes": list(costs.optimizer_bytes or ()),
        "reduce": list(costs.reduce or ()),
        "contention": costs.contention,
        "meta": dict(costs.meta),
    }


def costs_from_json(doc: Mapping[str, Any]) -> CostModel:
    """Inverse of :func:`costs_to_json`.

    Raises:
        ValueError: if the document is not a twobp cost file of a known
            version, or a field is missing or malformed.
    """
    if doc.get("format") != COSTS_FORMAT:
        raise ValueError(
            f"not a twobp cost file: 'format' is {doc.get('format')!r}, expected {COSTS_FORMAT!r}"
        )
    if doc.get("version") != COSTS_VERSION:
        raise ValueError(
            f"twobp cost file version {doc.get('version')!r} is not supported "
            f"(this twobp reads version {COSTS_VERSION}); re-run the profiler"
        )
    missing = [k for k in ("forward", "backward_input", "backward_weight") if k not in doc]
    if missing:
        raise ValueError(f"twobp cost file lacks {', '.join(missing)}")
    n = len(doc["forward"])
    if doc.get("n_stages", n) != n:
        raise ValueError(
            f"twobp cost file says n_stages={doc['n_stages']} but lists {n} forward times"
        )
    concat = doc.get("backward_weight_concat")
    bandwidth = doc.get("bandwidth")
    contention = doc.get("contention")
    return CostModel(
        forward=tuple(doc["forward"]),
        forward_full=_opt(doc.get("forward_full")),
        backward_input=tuple(doc["backward_input"]),
        backward_weight=tuple(doc["backward_weight"]),
        backward_full=_opt(doc.get("backward_full")),
        weight_concat=None
        if concat is None
        else tuple(None if t is None else {int(k): float(v) for k, v in t.items()} for t in concat),
        send_latency=float(doc.get("send_latency", 0.0)),
        send_overhead=float(doc.get("send_overhead", 0.0)),
        bandwidth=math.inf if bandwidth is None else float(bandwidth),
        reduce_bandwidth=None
        if doc.get("reduce_bandwidth") is None
        else float(doc["reduce_bandwidth"]),
        send_bytes=_opt(doc.get("send_bytes")),
        activation_bytes=_opt(doc.get("activation_bytes")),
        weight_grad_bytes=_opt(doc.get("weight_grad_bytes")),
        parameter_bytes=_opt(doc.get("parameter_bytes")),
        optimizer_bytes=_opt(doc.get("optimizer_bytes")),
        reduce=_opt(doc.get("reduce")),
        contention=1.0 if contention is None else float(contention),
        meta=dict(doc.get("meta") or {}),
    )


def _opt(values: Sequence[float] | None) -> PerStage | None:
    return None if not values else tuple(float(v) for v in values)


def load_costs(path: str | Path) -> CostModel:
    """Read a cost model from a JSON file (format in the module docstring).

    Raises:
        ValueError: if the file is not a valid twobp cost file.
        OSError: if it cannot be read.
    """
    with open(path, encoding="utf-8") as fh:
        try:
            doc = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
    try:
        return costs_from_json(doc)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def save_costs(costs: CostModel, path: str | Path) -> None:
    """Write ``costs`` as JSON to ``path``."""
    Path(path).write_text(json.dumps(costs_to_json(costs), indent=2) + "\n", encoding="utf-8")


# Keys of the short text form, and the CostModel.uniform argument each sets.
_TEXT_KEYS = {
    "f": "f",
    "i": "i",
    "w": "w",
    "b": "b",
    "latency": "send_latency",
    "send_overhead": "send_overhead",
    "bandwidth": "bandwidth",
    "reduce_bandwidth": "reduce_bandwidth",
    "send": "send_bytes",
    "act": "activation_bytes",
    "grad": "weight_grad_bytes",
    "param": "parameter_bytes",
    "opt": "optimizer_bytes",
    "contention": "contention",
    "jitter": "jitter",
    "seed": "jitter_seed",
}
_CONCAT_KEY = re.compile(r"^w(\d+)$")
_SIZE_SUFFIX = {
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_NUMBER = re.compile(r"^([0-9.eE+\-]+|inf)\s*([kKmMgGtT]i?)?[bB]?$")


def parse_amount(text: str) -> float:
    """Parse a number with an optional size suffix: ``2.5``, ``1e-3``, ``16GiB``, ``80GB``, ``inf``.

    Raises:
        ValueError: if ``text`` is not such a number.
    """
    match = _NUMBER.match(text.strip())
    if match is None:
        raise ValueError(f"cannot read {text!r} as a number (e.g. 2.5, 1e-3, 16GiB, 80GB)")
    number, suffix = match.groups()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a number (e.g. 2.5, 1e-3, 16GiB, 80GB)"
        ) from None
    return value * (_SIZE_SUFFIX[suffix.lower()] if suffix else 1.0)


def format_amount(value: float) -> str:
    """A memory size: binary units from 1 KiB up, else the plain number (cost-model units)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.4g}"


def parse_costs(text: str, n_stages: int) -> CostModel:
    """Build a uniform cost model from a short text such as ``"F=1,I=1,W=1"``.

    Keys (case-insensitive): ``F``, ``I``, ``W`` (times of one micro-batch),
    ``B`` (fused backward, default ``I+W``), ``W<n>`` (time of ``W`` over ``n``
    concatenated micro-batches, e.g. ``W4=3``), ``latency`` (seconds),
    ``bandwidth`` (bytes/s), ``reduce_bandwidth`` (bytes/s per rank of a
    gradient all-reduce), ``send_overhead`` (seconds the sender spends per
    transfer), ``send`` (bytes per micro-batch and boundary),
    ``act``, ``grad``, ``param`` (memory sizes, see :class:`CostModel`),
    ``contention`` (slowdown while every rank computes at once, e.g.
    ``contention=1.6``), ``jitter`` (the spread of each action's time, as a
    fraction of it, e.g. ``jitter=0.1``) and ``seed`` (which draw of it).
    Sizes accept suffixes such as ``MiB`` or ``GB``.

    Args:
        text: comma-separated ``key=value`` pairs; missing keys keep the
            defaults of :meth:`CostModel.uniform`.
        n_stages: number of stages.

    Returns:
        The cost model.

    Raises:
        ValueError: on an unknown key or a bad value.
    """
    kwargs: dict[str, float] = {}
    concat: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"cost {part!r} is not key=value (e.g. 'F=1,I=1,W=1')")
        concat_match = _CONCAT_KEY.match(key)
        if concat_match:
            concat[int(concat_match.group(1))] = parse_amount(value)
        elif key in _TEXT_KEYS:
            kwargs[_TEXT_KEYS[key]] = parse_amount(value)
        else:
            raise ValueError(
                f"unknown cost key {key!r} in {text!r}; known: F, I, W, B, W<n>, "
                f"{', '.join(k for k in _TEXT_KEYS if len(k) > 1)}"
            )
    if concat and "w" not in kwargs:
        kwargs["w"] = CostModel.uniform(1, weight_concat=concat).w_time(0, 1)
    jitter, seed = kwargs.pop("jitter", 0.0), int(kwargs.pop("jitter_seed", 0))
    model = CostModel.uniform(
        n_stages,
        f=kwargs.pop("f", 1.0),
        i=kwargs.pop("i", 1.0),
        w=kwargs.pop("w", 1.0),
        b=kwargs.pop("b", None),
        weight_concat=concat or None,
        **kwargs,
    )
    return replace(model, jitter=jitter, jitter_seed=seed) if jitter or seed else model
