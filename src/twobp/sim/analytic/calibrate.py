"""A device's figures fitted to blocks measured on it (``twobp profile --hardware-out``).

The analytic model times a layer as its weight matrices' FLOPs at one rate
and attention's at another (:meth:`Hardware.seconds`). Measured ``F``, ``I``
and ``W`` of real decoder layers give both: ``W`` is weight matrices only, so
its FLOPs over its time is the matrix rate, taken as the device's peak (an
efficiency of 1); what ``F`` and ``I`` take beyond their matrices at that
rate (attention, and with it the norms, rotary embedding and activations the
FLOP count leaves out) over attention's FLOPs gives attention's efficiency.
Rates depend on the shapes, so a device is calibrated at the micro-batch it
will be planned with. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from twobp.sim.analytic.hardware import Hardware
from twobp.sim.analytic.shapes import BlockCosts

MIN_EFFICIENCY = 1e-3
"""The least attention efficiency a fit gives (layers whose ``F`` and ``I`` are all
weight matrices leave nothing to attention)."""


def fit_hardware(
    base: Hardware,
    block: BlockCosts,
    measured: Sequence[tuple[float, float, float]],
    *,
    name: str,
    source: str,
) -> Hardware:
    """``base`` with its peaks and efficiencies fitted to measured layers.

    Args:
        base: the device's other figures (memory, bandwidths, devices per node).
        block: the analytic costs of one of the measured layers, at the measured shapes.
        measured: ``(F, I, W)`` seconds of each measured layer (all of ``block``'s shapes).
        name, source: of the result.

    Returns:
        A device whose :meth:`Hardware.seconds` gives the measured layers' mean
        ``W`` and mean ``F + I`` for ``block``.

    Raises:
        ValueError: no layers, or a time that is not positive.
    """
    if not measured:
        raise ValueError("fit_hardware: no measured layers")
    if any(not t > 0 for times in measured for t in times):
        raise ValueError(f"fit_hardware: times must be positive, got {list(measured)}")
    n = len(measured)
    forward = sum(t[0] for t in measured) / n
    backward_input = sum(t[1] for t in measured) / n
    weight = sum(t[2] for t in measured) / n
    peak = block.weight_matmul / weight
    matrices = (block.forward_matmul + block.input_matmul) / peak
    attention_flops = block.forward_attention + block.input_attention
    rest = forward + backward_input - matrices
    attention = (
        attention_flops / (rest * peak) if rest > 0 and attention_flops > 0 else MIN_EFFICIENCY
    )
    return replace(
        base,
        name=name,
        peak_bf16=peak,
        peak_fp32=peak,
        efficiency={"matmul": 1.0, "attention": max(attention, MIN_EFFICIENCY)},
        source=source,
    )
