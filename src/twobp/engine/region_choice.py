"""Which way a compiled region runs: compiled, or eagerly, chosen by timing both once.

A region between two captured calls is often small (a residual add, a
reshape, an activation). Where its compiled call costs more than its few eager
kernels (a CPU, one thread, small tensors: the compiled call's wrappers and its
autograd node weigh more than the fusion saves), the region runs eagerly: its
own graph's code, which records the same autograd graph as the eager module.
The choice is made once per region, on its first call, by running both on
copies of that call's inputs (forward and, where an output needs a gradient,
backward) a few times in turn and comparing the fastest of each (on a CPU with one
intra-op thread, by the thread's CPU time, which a busy machine does not inflate). Random
numbers are drawn from a fork of the generators, so the timing leaves the
model's random state as it found it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

RegionMode = Literal["measured", "compiled", "eager"]
"""How the regions of a cut graph run: each chosen by timing (``"measured"``),
all compiled, or all eager (only the cut, for debugging)."""

REGION_MODES: tuple[RegionMode, ...] = ("measured", "compiled", "eager")

TRIALS = 5
"""Timed runs of each way, in turn, after one untimed run of each."""

MARGIN = 0.97
"""The compiled region must take at most this share of the eager one's time:
where they are even, eager costs nothing more to keep."""


@dataclass
class RegionChoice:
    """How one region of a cut graph runs, and why."""

    name: str
    """``compiled_region_<k>`` of the graph (k from 1, in the graph's order)."""
    ops: int
    """How many calls the region holds."""
    mode: Literal["compiled", "eager"] | None = None
    """How it runs; None until its first call (measured)."""
    eager_s: float | None = None
    """The fastest eager run (forward and backward), seconds; None if not timed."""
    compiled_s: float | None = None
    """The fastest compiled run, seconds; None if not timed."""
    lean: bool = False
    """Whether its compiled graphs run from a plain autograd Function, not through
    AOTAutograd's runtime wrappers (:mod:`twobp.engine.lean_regions`)."""


def prefer_compiled(eager_s: float, compiled_s: float, margin: float = MARGIN) -> bool:
    """Whether the compiled region pays: faster than the eager one by ``margin``."""
    return compiled_s <= eager_s * margin


def _copies(args: Sequence[Any]) -> list[Any]:
    return [
        a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
        for a in args
    ]


def _devices(args: Sequence[Any]) -> list[int]:
    return sorted({a.device.index or 0 for a in args if isinstance(a, Tensor) and a.is_cuda})


def _clock(devices: list[int]) -> Callable[[], float]:
    """The thread's CPU time where the work is all on this thread (a CPU, one intra-op
    thread): unlike the wall clock it does not count the time other processes of a busy
    machine take from it. The wall clock otherwise (a GPU's kernels, several threads)."""
    if not devices and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _timed(run: Callable[..., Any], args: Sequence[Any], devices: list[int]) -> float:
    inputs = _copies(args)
    clock = _clock(devices)
    start = clock()
    out = run(*inputs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))]
    needs = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
    if needs:
        torch.autograd.backward(needs, [torch.ones_like(o) for o in needs])
    for d in devices:
        torch.cuda.synchronize(d)
    return clock() - start


def time_both(
    eager: Callable[..., Any], compiled: Callable[..., Any], args: Sequence[Any]
) -> tuple[float, float]:
    """The fastest of :data:`TRIALS` runs of each on copies of ``args``, in turn.

    Returns:
        ``(eager_s, compiled_s)``.
    """
    devices = _devices(args)
    times: tuple[list[float], list[float]] = ([], [])
    with torch.random.fork_rng(devices=devices):
        for trial in range(TRIALS + 1):
            for k, run in enumerate((eager, compiled)):
                t = _timed(run, args, devices)
                if trial:
                    times[k].append(t)
    return min(times[0]), min(times[1])
