"""Automatic partitioning: split a model's blocks into balanced pipeline stages.

:mod:`twobp.partition.solver` is pure (no torch): given a cost per block it
finds the contiguous split whose slowest stage is fastest.
:mod:`twobp.partition.profiler` measures those costs on a real device.
"""

from twobp.partition.solver import (
    Partition,
    check_partition,
    evaluate,
    solve,
    stage_ranges,
    uniform,
)

__all__ = ["Partition", "check_partition", "evaluate", "solve", "stage_ranges", "uniform"]
