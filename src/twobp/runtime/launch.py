"""Start a process group on this machine and run a function on every rank.

:func:`launch` is a small local stand-in for ``torchrun``: it starts one
process per rank, initialises the default group in each (``env://`` on a free
port of 127.0.0.1), runs ``fn(*args)`` and brings each rank's return value
back to the caller. If a rank fails or is killed, the others get a grace
period to fail on their own (they notice the closed connections), then are
terminated, and :class:`LaunchError` lists what happened on every rank, the
cause first. A rank that stalls makes its peers time out; the launcher then
terminates it, names it as stuck and shows where it was (its stack, dumped by
``faulthandler`` on ``SIGTERM``).

Results and errors come back through files in a temporary folder rather than
a queue: a file written before exit survives a peer's crash, and tensors in a
result are pickled by value.

Ranks start from a fork server where the platform has one (Linux, macOS): one
process that imported torch and twobp once, and forks each rank from there in
a fraction of a second, where a freshly spawned interpreter spends seconds
importing torch. The server also imports ``torch._dynamo``, which torch imports
on the first optimizer built in a process (and ``torch.compile`` needs): each
rank would otherwise spend about a second importing it. As with ``spawn``,
``fn`` and its arguments are pickled and the script's main module is imported
again in each rank (so the launch must sit under ``if __name__ == "__main__":``);
each rank gets the caller's environment as it is at the call. A rank ends as
forked processes do, without the interpreter's exit (``atexit`` handlers do not
run): ``start_method="spawn"`` gives each rank a whole interpreter of its own
instead.

The fork server (and multiprocessing's resource tracker, which starts with it)
never see SIGHUP: a terminal that closes hangs up its whole process group, and
a server gone looks to the launcher like the death of every rank it forked.
The ranks get SIGHUP as the caller does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from twobp.runtime.base.group import backend_for, default_device, init_default_group
from twobp.runtime.errors import LaunchError, PeerError, RankFailure

T = TypeVar("T")

_POLL_SECONDS = 0.05
# A rank's process name is this prefix, its rank and the launch's folder: a rank that
# runs launch() again as it imports the main script (no ``if __name__ == "__main__":``)
# leaves a mark in that folder and ends quietly. (Multiprocessing gives a starting rank
# its name before it imports the script; a forked rank has the server's environment.)
_NAME_PREFIX = "twobp-rank-"
_UNGUARDED = "unguarded"
UNGUARDED_MESSAGE = (
    'twobp.launch needs an `if __name__ == "__main__":` guard around its call: every rank '
    "imports the main script again, and this one calls launch as it is imported"
)
# What the fork server imports once, before it forks the ranks (torch._dynamo: every
# optimizer's constructor imports it).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "twobp"]
START_METHODS = ("forkserver", "spawn")
"""The ways :func:`launch` starts its ranks."""
# After SIGTERM, how long a process may take to exit before SIGKILL.
_TERMINATE_SECONDS = 2.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    fn: Callable[..., T],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    threads_per_rank: int | None = None,
    grace_period: float = 5.0,
    timeout: float | None = None,
    group_timeout: float = 300.0,
    start_method: str | None = None,
) -> list[T]:
    """Run ``fn(*args)`` on ``nprocs`` ranks of a fresh process group.

    Args:
        fn: a picklable (module-level) function; it runs in each child after
            the default group is initialised and may call
            ``torch.distributed.get_rank()``.
        nprocs: number of processes (ranks).
        *args: picklable arguments passed to ``fn`` on every rank.
        backend: ``"gloo"`` or ``"nccl"``; None picks NCCL when each rank can
            have its own GPU, gloo otherwise.
        threads_per_rank: intra-op threads per child; None shares the cores
            evenly (at least 1).
        grace_period: seconds the other ranks get to end after one fails,
            before they are terminated.
        timeout: seconds for the whole run; None waits as long as it takes.
        group_timeout: the default group's collective timeout, in seconds.
        start_method: ``"forkserver"`` (fork the ranks from a server that has
            imported torch and twobp: fast) or ``"spawn"`` (a new interpreter
            per rank, which exits as a script does); None: ``forkserver`` where
            the platform has it, else ``spawn``.

    Returns:
        The return value of ``fn`` on each rank, indexed by rank.

    Raises:
        LaunchError: if any rank raised, was killed or was terminated; it names
            each failed rank with its exception or signal, the first first. A launch
            whose port another process took before rank 0 listened on it (no rank ran
            ``fn`` yet) is started again on a new port first, up to 3 times.
        ValueError: if ``nprocs < 1`` or ``start_method`` is not one of
            :data:`START_METHODS`.
    """
    _end_if_starting_a_rank()
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = _context(start_method)
    if backend is None:
        cuda_ok = torch.cuda.is_available() and torch.cuda.device_count() >= nprocs
        backend = backend_for(default_device()) if cuda_ok else "gloo"
    if threads_per_rank is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        threads_per_rank = max(1, (cores or os.cpu_count() or 1) // nprocs)
    attempt = 1
    while True:
        try:
            return _launch_once(
                ctx, fn, args, nprocs, free_port(), backend, threads_per_rank, grace_period,
                timeout, group_timeout,
            )  # fmt: skip
        except LaunchError as exc:
            if attempt >= _PORT_ATTEMPTS or not group_not_formed(exc):
                raise
            attempt += 1


_PORT_ATTEMPTS = 3
"""Launches tried, each on a new port, while the ranks fail to form their group for
another process's sockets (:func:`group_not_formed`; before any rank runs ``fn``)."""


def group_not_formed(exc: LaunchError) -> bool:
    """Whether a launch failed only because its ranks could not form their group: rank 0
    could not listen on its port (another process took it after :func:`free_port` found it
    free), or gloo could not connect two ranks (a port of 127.0.0.1 it dialled was closed by
    another process's sockets). No rank ran ``fn`` then."""
    first = exc.failures[0] if exc.failures else None
    if first is None or "init_default_group" not in first.traceback:
        return False
    if first.error_type == "DistNetworkError" and "EADDRINUSE" in first.message:
        return True
    return "connectFullMesh failed" in first.message


def _launch_once(
    ctx: Any,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    nprocs: int,
    port: int,
    backend: str,
    threads_per_rank: int,
    grace_period: float,
    timeout: float | None,
    group_timeout: float,
) -> list[T]:
    """One launch of ``fn`` on ``nprocs`` ranks whose group listens on ``port``."""
    folder = Path(tempfile.mkdtemp(prefix="twobp-launch-"))
    try:
        procs = [
            ctx.Process(
                target=_child_main,
                args=(fn, args, rank, nprocs, port, str(folder), backend, threads_per_rank),
                kwargs={
                    "group_timeout": group_timeout,
                    "environment": dict(os.environ),
                    "output": _caller_output(ctx),
                },
                name=f"{_NAME_PREFIX}{rank} {folder}",
            )
            for rank in range(nprocs)
        ]
        try:
            with _hang_up_held():
                for proc in procs:
                    proc.start()
            terminated = _supervise(procs, grace_period, timeout)
        except BaseException:
            # Interrupted (Ctrl-C) or failed to start: leave no rank behind.
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            raise
        if (folder / _UNGUARDED).exists():
            raise LaunchError([], nprocs, UNGUARDED_MESSAGE)
        return _collect(procs, folder, terminated)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _hang_up_held() -> Iterator[None]:
    """Block SIGHUP in this thread while ranks start, then deliver it if it came.

    A process started now inherits the mask: the fork server and the resource
    tracker keep SIGHUP blocked for good (as multiprocessing blocks SIGINT and
    SIGTERM for the tracker), and each rank unblocks it as it starts
    (:func:`_child_main`).
    """
    if not hasattr(signal, "SIGHUP") or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


def _end_if_starting_a_rank() -> None:
    """End this process at once if it is a rank of :func:`launch` that is still starting.

    A spawned rank imports the caller's main script before it runs anything; a
    script that calls ``launch`` unguarded calls it again there, where
    multiprocessing would fail with a long traceback on every rank. The rank
    marks it for the launcher instead, which raises one line.
    """
    starting = getattr(mp.current_process(), "_inheriting", False)
    name = mp.current_process().name
    folder = name.split(" ", 1)[1] if name.startswith(_NAME_PREFIX) and " " in name else None
    if starting and folder:
        (Path(folder) / _UNGUARDED).touch()
        os._exit(1)


def _context(start_method: str | None) -> Any:
    """The multiprocessing context that starts the ranks."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(START_METHODS)} or None, got {start_method!r}"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Read when the server starts (the first launch of this process); later calls
        # find it running.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _CallerFd:
    """A file descriptor of the caller that a forked rank receives as its own."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank starts: the fork server passes the descriptor along.
        return (_received, (multiprocessing.reduction.DupFd(self.fd),))


def _received(duplicate: Any) -> int:
    return int(duplicate.detach())


def _caller_output(ctx: Any) -> tuple[Any, Any] | None:
    """The caller's stdout and stderr as they are now, for a rank forked by the server
    (which would write where the server's went, the caller's at its first launch)."""
    if ctx.get_start_method() != "forkserver":
        return None  # a spawned rank inherits them
    return _CallerFd(1), _CallerFd(2)


def _supervise(procs: list[Any], grace_period: float, timeout: float | None) -> dict[int, str]:
    """Wait for all processes; after a failure (or the timeout), terminate the rest.

    Returns:
        For each rank the launcher terminated, why.
    """
    started = time.monotonic()
    failed_at: float | None = None
    reason = ""
    terminated: dict[int, str] = {}
    while any(p.is_alive() for p in procs):
        alive = [p for p in procs if p.is_alive()]
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=_POLL_SECONDS)
        now = time.monotonic()
        if failed_at is None:
            bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad:
                failed_at, reason = now, f"terminated by the launcher after rank {bad[0]} failed"
            elif timeout is not None and now - started > timeout:
                failed_at, reason = now - grace_period, f"terminated: launch timeout {timeout}s"
        if failed_at is not None and now - failed_at > grace_period:
            for rank, proc in enumerate(procs):
                if proc.is_alive():
                    terminated[rank] = reason
                    proc.terminate()
            deadline = time.monotonic() + _TERMINATE_SECONDS
            for proc in procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return terminated


def _collect(procs: list[Any], folder: Path, terminated: dict[int, str]) -> list[Any]:
    """Read each rank's result, or raise :class:`LaunchError` listing the failures.

    The failures are ordered cause first: a rank that raised an error of its
    own or was killed, or a rank that others timed out waiting on and that
    the launcher had to terminate (stuck); then the ranks that failed because
    of a peer; then the other terminated ranks.
    """
    results: list[Any] = []
    failures: dict[int, RankFailure] = {}
    for rank, proc in enumerate(procs):
        ok, err = folder / f"rank{rank}.ok", folder / f"rank{rank}.err"
        if proc.exitcode == 0 and ok.exists():
            results.append(pickle.loads(ok.read_bytes()))
            continue
        if err.exists():
            failures[rank] = RankFailure(rank, proc.exitcode, **pickle.loads(err.read_bytes()))
        elif rank in terminated:
            stack_file = folder / f"rank{rank}.stack"
            stack = stack_file.read_text(errors="replace") if stack_file.exists() else ""
            failures[rank] = RankFailure(rank, proc.exitcode, message=terminated[rank], stack=stack)
        else:
            failures[rank] = RankFailure(rank, proc.exitcode, message=_describe_exit(proc.exitcode))
    if not failures:
        return results
    waited_on = {_waited_on(f, len(procs)) for f in failures.values()}
    for rank in sorted(r for r in waited_on if r in terminated and r in failures):
        failure = failures[rank]
        failures[rank] = dataclasses.replace(
            failure,
            stuck=True,
            message=f"stuck: rank(s) {_ranks_waiting(failures, rank, len(procs))} timed out "
            f"waiting on it; {failure.message}",
        )

    def order(f: RankFailure) -> tuple[int, float, int]:
        if f.stuck or (f.rank not in terminated and f.error_type not in _PEER_ERRORS):
            group = 0
        elif f.error_type in _PEER_ERRORS:
            group = 1
        else:
            group = 2
        return (group, f.when or float("inf"), f.rank)

    raise LaunchError(sorted(failures.values(), key=order), len(procs))


_PEER_ERRORS = ("PeerError", "PeerFailedError", "PeerStepFailedError", "PeerTimeoutError")


def _waited_on(failure: RankFailure, nprocs: int) -> int | None:
    """The rank a time-out names (the other rank of a 2-rank collective), else None."""
    if failure.error_type != "PeerTimeoutError":
        return None
    if failure.peer is None and nprocs == 2:
        return 1 - failure.rank
    return failure.peer


def _ranks_waiting(failures: dict[int, RankFailure], rank: int, nprocs: int) -> str:
    waiting = [r for r, f in sorted(failures.items()) if _waited_on(f, nprocs) == rank]
    return ", ".join(map(str, waiting))


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode} without reporting an error"


def _child_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    nprocs: int,
    port: int,
    folder: str,
    backend: str,
    threads: int,
    *,
    group_timeout: float,
    environment: dict[str, str],
    output: tuple[int, int] | None,
) -> None:
    """Body of one rank: set the environment and output, join the group, run, report."""
    if hasattr(signal, "SIGHUP") and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # see _hang_up_held
    if output is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, received in zip((1, 2), output, strict=True):
            os.dup2(received, fd)
            os.close(received)
    # A forked rank starts with the fork server's environment: make it the caller's.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    # If the launcher has to terminate this rank (stuck, or after a peer
    # failed), the stack tells where it was; the default action then ends it.
    stack_file = (Path(folder) / f"rank{rank}.stack").open("w")
    faulthandler.register(signal.SIGTERM, file=stack_file, all_threads=False, chain=True)
    try:
        # Under NCCL: set_device and device_id (cuda:<local rank>), so that NCCL connects at once.
        init_default_group(backend, group_timeout, init_method="env://")
        result = fn(*args)
        _write(Path(folder) / f"rank{rank}.ok", result)
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        report = {
            "error_type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
            "when": time.time(),
            "peer": exc.peer if isinstance(exc, PeerError) else None,
        }
        traceback.print_exc()
        _write(Path(folder) / f"rank{rank}.err", report)
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit at once, without tearing the group down: the closed sockets tell
        # the peers that this rank is gone, so they fail fast instead of hanging.
        os._exit(1)
    dist.destroy_process_group()
    faulthandler.unregister(signal.SIGTERM)
    stack_file.close()


def _write(path: Path, value: Any) -> None:
    """Pickle ``value`` to ``path`` atomically (the reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(value))
    tmp.replace(path)
