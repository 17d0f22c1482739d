"""The process group a pipeline runs in: join one, or run as a world of one.

:func:`join_world` looks, in order, for a group passed by the caller, an
already initialised default group, and the environment a launcher sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``: ``torchrun`` or
:func:`twobp.runtime.launch`). With none of these it runs as a single process
world: all stages on rank 0, no communication.
"""

from __future__ import annotations

import datetime
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from twobp.runtime.base.process_state import destroy_at_exit
from twobp.runtime.errors import PipelineClosedError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables that tell a process it belongs to a launched group."""


@dataclass(frozen=True)
class Membership:
    """Where this process stands in the group.

    The world refers to its process group weakly: a pipeline never keeps a
    group alive. When the group's owner (torch's default group registry, or
    the caller that made it) destroys it, its worker threads stop then and
    there, while the interpreter still runs, instead of at exit, where a gloo
    worker that still holds a finished operation aborts the process.

    Args:
        rank: this process's rank in ``group``.
        size: number of processes in ``group``.
        local_size: number of processes of the group on this machine.
        group: the process group; None in a single process world.
        backend: the group's backend (``"gloo"``, ``"nccl"``), None when alone.
    """

    rank: int
    size: int
    local_size: int
    group_ref: weakref.ref[dist.ProcessGroup] | None = field(repr=False)
    backend: str | None

    @classmethod
    def of(
        cls,
        rank: int,
        size: int,
        local_size: int,
        group: dist.ProcessGroup | None,
        backend: str | None,
    ) -> Membership:
        """A world in ``group`` (held weakly), or a single process world if None."""
        ref = weakref.ref(group) if group is not None else None
        return cls(rank, size, local_size, ref, backend)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group; None in a single process world.

        Raises:
            PipelineClosedError: if the group was destroyed since.
        """
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:
            raise PipelineClosedError(
                f"rank {self.rank}: the process group of this pipeline was destroyed "
                "(torch.distributed.destroy_process_group); a pipeline cannot outlive its "
                "group: build a new Pipeline after init_process_group"
            )
        return group

    @property
    def is_single(self) -> bool:
        """True when this process is the whole world (no communication)."""
        return self.group_ref is None

    def global_rank(self, rank: int) -> int:
        """The default-group rank of ``rank`` of this group (what p2p calls take)."""
        group = self.group
        if group is None:
            return rank
        return dist.get_global_rank(group, rank)


def local_rank() -> int:
    """This process's rank on its machine (``LOCAL_RANK``; 0 if unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """The GPU of this local rank if CUDA is available, else the CPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return device_of_local_rank(local_rank(), count)


def device_of_local_rank(rank: int, cuda_devices: int) -> torch.device:
    """``cuda:<rank mod cuda_devices>``, or the CPU without CUDA devices (no CUDA call)."""
    if cuda_devices > 0:
        return torch.device("cuda", rank % cuda_devices)
    return torch.device("cpu")


def bound_device(backend: str, device: torch.device, rank: int) -> torch.device | None:
    """The GPU a default group of ``backend`` is bound to, or None (no CUDA call).

    Under NCCL the group is bound to this rank's GPU: ``device`` if it names
    one, else ``cuda:<local rank>``. Passed as ``device_id`` to
    ``init_process_group``, it makes NCCL create its communicators at once, in
    the order every rank makes its groups, instead of lazily at the first
    operation of each; and ``torch.cuda.set_device`` makes it the current
    device, on which NCCL's own allocations land. Other backends bind nothing.

    Args:
        backend: the default group's backend.
        device: the device this rank computes on.
        rank: this process's local rank.
    """
    if "nccl" not in backend:
        return None
    if device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", rank)


def init_default_group(
    backend: str, timeout: float, device: torch.device | None = None, **how: Any
) -> None:
    """``init_process_group`` of ``backend``, bound to this rank's GPU under NCCL.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: seconds, the group's collective timeout.
        device: the device this rank computes on (None: by the local rank).
        how: where the group meets (``init_method`` or ``store``, ``rank``,
            ``world_size``), passed on.
    """
    if device is None:
        count = torch.cuda.device_count() if "nccl" in backend else 0
        device = device_of_local_rank(local_rank(), count)
    bound = bound_device(backend, device, local_rank())
    if bound is not None:
        torch.cuda.set_device(bound)
        how["device_id"] = bound
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **how)


def device_for(world: Membership) -> torch.device:
    """The default device of a pipeline in ``world``: a GPU unless the backend is CPU-only.

    A gloo group cannot move CUDA tensors point-to-point, so under gloo the
    pipeline computes on the CPU even where a GPU exists.
    """
    backend = world.backend or ""
    if world.backend is not None and "nccl" not in backend:
        return torch.device("cpu")
    return default_device()


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def launched_by_env() -> bool:
    """True if a launcher set the variables of ``env://`` initialisation."""
    return all(v in os.environ for v in LAUNCHER_VARIABLES)


def join_world(
    device: torch.device, timeout: float, group: dist.ProcessGroup | None = None
) -> Membership:
    """Find or create the process group this pipeline runs in.

    Args:
        device: the device this rank computes on; picks the backend when this
            function initialises the default group.
        timeout: seconds, the collective timeout of a group created here.
        group: an existing group to use; None to use the default group.

    Returns:
        The world: ``group`` if given, else the default group (initialised from
        the launcher's environment if needed), else a single process world.

    Raises:
        RuntimeError: if initialising the default group fails.
    """
    if group is None and not dist.is_initialized() and launched_by_env():
        init_from_env(backend_for(device), timeout, device)
    if group is None and not dist.is_initialized():
        return Membership.of(rank=0, size=1, local_size=1, group=None, backend=None)
    active = group if group is not None else dist.group.WORLD
    assert active is not None
    size = dist.get_world_size(active)
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    return Membership.of(
        rank=dist.get_rank(active),
        size=size,
        local_size=max(1, local_size),
        group=active,
        backend=str(dist.get_backend(active)),
    )


def init_from_env(backend: str, timeout: float, device: torch.device | None = None) -> None:
    """Initialise the default group from the launcher's environment (``env://``).

    ``torchrun --max-restarts`` keeps one store for all the attempts of a
    group. Under plain ``env://`` a rank of a restarted group can read the
    address that a dead rank of the previous attempt left in it, and fail with
    "Connection refused". Under torchrun the keys of each attempt
    (``TORCHELASTIC_RESTART_COUNT``) therefore go under a prefix of their own.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: seconds, the group's collective timeout.
        device: the device this rank computes on (see :func:`init_default_group`).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        init_default_group(backend, timeout, device, init_method="env://")
    else:
        _init_attempt(backend, attempt, timeout, device)
    assert dist.group.WORLD is not None
    destroy_at_exit(dist.group.WORLD)


def _init_attempt(backend: str, attempt: str, timeout: float, device: torch.device | None) -> None:
    """Initialise the default group of torchrun's restart ``attempt`` under its own prefix."""
    delta = datetime.timedelta(seconds=timeout)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The agent hosts the store when it says so; otherwise rank 0 does, as env:// would.
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        size,
        is_master=not agent_hosts and rank == 0,
        timeout=delta,
        multi_tenant=not agent_hosts,
    )
    prefixed = dist.PrefixStore(f"twobp/attempt-{attempt}/", store)  # type: ignore[attr-defined]
    init_default_group(backend, timeout, device, store=prefixed, rank=rank, world_size=size)


def set_threads_per_rank(local_size: int, num_threads: int | None) -> int:
    """Share this machine's cores between its ranks, unless the user chose.

    Args:
        local_size: ranks on this machine.
        num_threads: an explicit thread count, or None for the default: a fair
            share of the cores (cores / local ranks). The default only lowers
            the count, never raises it, and leaves it alone when
            ``OMP_NUM_THREADS`` is set.

    Returns:
        The number of intra-op threads now in use.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        return num_threads
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        share = max(1, (cores or os.cpu_count() or 1) // max(1, local_size))
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)
    return torch.get_num_threads()
