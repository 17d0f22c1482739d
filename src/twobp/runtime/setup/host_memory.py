"""Keep the memory a CPU process frees for its next allocations (glibc's malloc).

A training step allocates its activations, stashes and gradients, and frees
them by the step's end. With its default settings glibc's malloc gives large
freed blocks back to the operating system: blocks above its mmap threshold
are unmapped at once, and a heap whose free top exceeds its trim threshold is
shrunk. The next step then asks for the same memory again, and each of its
pages faults and is zeroed by the kernel on first touch. On a CPU pipeline
that is up to tens of thousands of page faults per step and rank (a fused
backward allocates each micro-batch's weight gradient afresh), and steps
11-18% longer (``docs/performance.md``, "Time between actions").

:func:`retain_freed_memory` raises both thresholds, so that the process keeps
what it frees and reuses it, as PyTorch's CUDA caching allocator does with
device memory. The process's resident memory then stays at its peak instead
of falling between steps. It is a setting of the whole process (like
``torch.set_num_threads``) and is a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

M_TRIM_THRESHOLD = -1
"""glibc's ``mallopt`` parameter: free heap top above which the heap is shrunk."""
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: size above which a block is mapped on its own."""
TRIM_THRESHOLD = 2**31 - 1
"""Bytes of free heap top kept (the largest value ``mallopt`` takes: no trimming in practice)."""
MMAP_THRESHOLD = 2**30
"""Blocks of 1 GiB and more are still mapped on their own (and unmapped when freed)."""

log = logging.getLogger("twobp")


def retain_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process for later allocations.

    Returns:
        True if both settings took effect; False where the C library is not
        glibc (macOS, musl, Windows), which keep their own behaviour.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    retained = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    )
    if not retained:
        log.debug("glibc refused the malloc thresholds; freed memory goes back to the system")
    return retained
