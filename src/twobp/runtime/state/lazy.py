"""Import a module on first use: what only a checkpoint needs is not loaded at start.

``storage`` is :mod:`twobp.runtime.state.checkpoint.storage` for the modules
that save and load checkpoints, imported when they first use it.

``torch.distributed.checkpoint`` takes about a second to import in every rank,
and importing it after the default process group exists makes some of its
functions hold that group as a default argument for good (so that
``destroy_process_group`` no longer frees it). A pipeline that never saves
or loads needs neither.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LazyModule", "lazy_module", "storage"]


class LazyModule:
    """Stands for module ``name`` and imports it on the first attribute read.

    Not registered in ``sys.modules``: nothing that walks the loaded modules
    (``inspect``, torch's registration of operators) can set the import off
    half-way through another.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_module(name: str) -> Any:
    """A :class:`LazyModule` for ``name`` (typed as the module where it is used)."""
    return LazyModule(name)


if TYPE_CHECKING:
    from twobp.runtime.state.checkpoint import storage
else:
    storage = lazy_module("twobp.runtime.state.checkpoint.storage")
