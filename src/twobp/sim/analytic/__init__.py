"""Analytic costs of a decoder from its shapes, and a table of devices.

:mod:`.shapes` gives a LLaMA-like decoder's parameters, FLOPs of ``F``, ``I``
and ``W`` per block and the bytes it holds; :mod:`.hardware` the peak FLOP/s,
memory and bandwidths of a device kind; :mod:`.layout` turns both into the
simulator's :class:`twobp.sim.costs.CostModel` for each pipeline layout and
ranks them with :func:`twobp.sim.search.search`; :mod:`.sharding` compares one
layout with its parameters sharded over the copies and without. Imports no torch.
"""

from twobp.sim.analytic.hardware import HARDWARE, Hardware, load_hardware
from twobp.sim.analytic.layout import Layout, plan_layouts
from twobp.sim.analytic.shapes import PRESETS, BlockCosts, DecoderShape, decoder_shape
from twobp.sim.analytic.sharding import ShardingRow, compare_sharding

__all__ = [
    "HARDWARE",
    "PRESETS",
    "BlockCosts",
    "DecoderShape",
    "Hardware",
    "Layout",
    "ShardingRow",
    "compare_sharding",
    "decoder_shape",
    "load_hardware",
    "plan_layouts",
]
