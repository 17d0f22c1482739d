"""Timing and memory of one step, on every rank.

Timing: a barrier lines the ranks up, then the step runs; for a pipeline the
clock stops after a second barrier (the step is over when the slowest rank is
done), for a single-process reference as soon as this rank is done. Beside
the wall time, the CPU time the rank's process spent in the step (all its
threads): when it is well below the wall time, the rank waited, or other work
on the machine held the cores.

Memory: on CUDA, the peak of ``torch.cuda.max_memory_allocated`` during the
step above what was allocated before it. On the CPU there is no allocator
counter, so :func:`step_peak_bytes` runs the step under ``torch.profiler``
with ``profile_memory`` and replays its allocation events: the peak of the
bytes allocated and not yet freed since the step began. Parameters and
anything held from earlier steps are not counted; activations, the 2BP stash,
received buffers and the new gradients are. The process-wide peak resident
size (:func:`peak_rss_bytes`) is reported next to it.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from twobp_bench.runner import StepRunner


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    """Line the ranks up (a no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def timed_step(
    runner: StepRunner, device: torch.device, profiler: cProfile.Profile | None = None
) -> tuple[float, float]:
    """One step of ``runner``, measured as the module docstring says.

    Args:
        runner: the variant.
        device: where it computes.
        profiler: a profiler to run during the step only (None: none).

    Returns:
        The wall seconds of the step and this rank's CPU seconds in it.
    """
    barrier()
    synchronize(device)
    start, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    try:
        runner.step()
        synchronize(device)
    finally:
        if profiler is not None:
            profiler.disable()
    cpu = time.process_time() - cpu
    if runner.collective:
        barrier()
    return time.perf_counter() - start, cpu


def step_peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The most bytes the step held at once beyond what was allocated before it.

    Args:
        step: runs the step.
        device: where the step allocates.

    Returns:
        The peak in bytes.
    """
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    # The profiler's C++ side prints a line on stderr at every start and stop.
    with _quiet_stderr():
        profiler.start()
    try:
        step()
    finally:
        with _quiet_stderr():
            profiler.stop()
    return _peak_of_allocations(profiler)


def _peak_of_allocations(profiler: torch.profiler.profile) -> int:
    results = profiler.profiler.kineto_results if profiler.profiler is not None else None
    if results is None:
        return 0
    events = sorted(
        (e.start_ns(), int(e.nbytes()))  # type: ignore[attr-defined]
        for e in results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for a moment (C++ output included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_rss_bytes() -> int:
    """The peak resident set size of this process so far, in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
