"""Fixtures several test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime_models import one_thread


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """Torch on one thread for the whole module (the machine is shared), then restored."""
    with one_thread():
        yield
