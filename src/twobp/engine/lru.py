"""A bounded map that forgets its least recently used entry first.

The compiled engine keeps what it made for reuse (the frame code of a container class, a
compiled region's code): each such cache is an :class:`LruCache` held by its module, with a
size of its own, so that memory does not grow with every model a process compiles. What an
entry held is made again on demand once it is gone; only time is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """At most ``size`` entries; storing one more forgets the least recently used.

    Args:
        size: how many entries it keeps (at least 1).

    Raises:
        ValueError: if ``size`` is below 1.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size={size}: an LruCache keeps at least 1 entry")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value stored under ``key`` (now the most recently used), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Store ``value`` under ``key`` as the most recently used, forgetting the least
        recently used entry if the cache is then over its size."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored (without making it the most recently used)."""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
