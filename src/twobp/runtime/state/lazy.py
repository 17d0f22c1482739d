"""Import a module on first use: what only a checkpoint needs is not loaded at start.

``torch.distributed.checkpoint`` takes about a second to import in every rank,
and importing it after the default process group exists makes some of its
functions hold that group as a default argument for good (so that
``destroy_process_group`` no longer frees it). A pipeline that never saves
or loads needs neither.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """Module ``name``, executed on its first attribute access (``importlib.util.LazyLoader``).

    Raises:
        ModuleNotFoundError: if there is no such module.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
