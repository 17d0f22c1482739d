"""A launch whose port another process takes before rank 0 listens on it, or whose gloo
ranks cannot connect, starts again on a new port (no rank ran the function yet); any other
failure is raised as it is."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Iterator

import pytest

from twobp.runtime import LaunchError, launch
from twobp.runtime.errors import RankFailure

# the module (``twobp.runtime.launch`` is also the name of the function it exports)
launching = importlib.import_module("twobp.runtime.launch")


def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _fails() -> None:
    raise ValueError("the function's own error")


@pytest.fixture
def ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The ports ``free_port`` answers: the first one held by a listening socket (another
    process's), free ones after."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    answered: list[int] = []
    real = launching.free_port

    def free_port() -> int:
        answered.append(real() if answered else held.getsockname()[1])
        return answered[-1]

    monkeypatch.setattr(launching, "free_port", free_port)
    yield answered
    held.close()


def test_a_launch_whose_port_was_taken_starts_again_on_another(ports: list[int]) -> None:
    assert launch(_rank_and_size, 2, threads_per_rank=1, timeout=120) == [(0, 2), (1, 2)]
    assert len(ports) == 2 and ports[0] != ports[1]


def test_other_failures_are_raised_after_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = launching.free_port
    monkeypatch.setattr(launching, "free_port", lambda: calls.append(real()) or calls[-1])
    with pytest.raises(LaunchError, match="the function's own error") as caught:
        launch(_fails, 2, threads_per_rank=1, timeout=120)
    assert not launching.group_not_formed(caught.value)
    assert len(calls) == 1


def _failed_in(message: str, where: str, error_type: str = "RuntimeError") -> LaunchError:
    trace = f'  File "twobp/runtime/{where}", line 1, in {where}\n'
    return LaunchError([RankFailure(1, 1, error_type, message, trace)], 2)


def test_a_gloo_mesh_that_could_not_connect_is_launched_again() -> None:
    mesh = "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer"
    assert launching.group_not_formed(_failed_in(mesh, "init_default_group"))
    # the same words from the function itself (it ran): raised as they are
    assert not launching.group_not_formed(_failed_in(mesh, "worker"))
    taken = "The server socket has failed to listen on any local network address. EADDRINUSE"
    assert launching.group_not_formed(_failed_in(taken, "init_default_group", "DistNetworkError"))
    assert not launching.group_not_formed(_failed_in("out of memory", "init_default_group"))
