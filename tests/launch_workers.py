"""Functions that tests/test_runtime_launch.py runs on launched ranks."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def say_and_read(name: str) -> str | None:
    """Print a line on stdout and on stderr; return the environment variable ``name``."""
    rank = dist.get_rank()
    print(f"out of rank {rank}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
    return os.environ.get(name)


def modules_at_start(names: list[str]) -> list[bool]:
    """Whether each module was imported before the rank ran anything."""
    return [name in sys.modules for name in names]
