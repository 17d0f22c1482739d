"""The bounded map behind the compiled engine's caches (:mod:`twobp.engine.lru`)."""

from __future__ import annotations

import pytest

from twobp.engine.lru import LruCache


def test_storing_past_the_size_forgets_the_least_recently_used() -> None:
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)
    assert len(cache) == 2
    assert "a" not in cache and cache.get("a") is None
    assert cache.get("b") == 2 and cache.get("c") == 3


def test_a_hit_makes_an_entry_the_most_recently_used() -> None:
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # now b is the least recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    cache.put("c", 4)  # storing again refreshes too
    cache.put("d", 5)
    assert "a" not in cache and cache.get("c") == 4 and cache.get("d") == 5


def test_clear_forgets_everything() -> None:
    cache: LruCache[str, int] = LruCache(3)
    cache.put("a", 1)
    cache.clear()
    assert len(cache) == 0 and cache.get("a") is None


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="size=0: an LruCache keeps at least 1 entry"):
        LruCache(0)
