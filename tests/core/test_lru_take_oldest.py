""":class:`lmcache_async.lru.LruIndex`: the key view, indexing, touching lookups and ``take_oldest``."""

from __future__ import annotations

import pytest

from lmcache_async.lru import LruIndex


def _index() -> LruIndex[str, int]:
    return LruIndex([("a", 1, 10), ("b", 2, 20), ("c", 3, 30)])


def test_the_key_view_is_live() -> None:
    idx = _index()
    keys = idx.keys()
    assert "a" in keys and list(keys) == ["a", "b", "c"]
    idx.pop("a")
    idx.put("d", 4, 1)
    assert "a" not in keys and "d" in keys
    idx.clear()
    assert len(keys) == 0


def test_indexing_reads_a_value_without_touching_and_raises_for_a_missing_key() -> None:
    idx = _index()
    assert idx["b"] == 2 and list(idx) == ["a", "b", "c"]
    with pytest.raises(KeyError):
        idx["z"]


def test_lookup_touches_only_when_asked() -> None:
    idx = _index()
    assert idx.lookup("a", touch=False) == 1 and list(idx) == ["a", "b", "c"]
    assert idx.lookup("a") == 1 and list(idx) == ["b", "c", "a"]
    assert idx.lookup("z") is None and list(idx) == ["b", "c", "a"]


def test_take_oldest_removes_just_enough_bytes_oldest_first() -> None:
    idx = _index()
    assert idx.take_oldest(25) == [("a", 1), ("b", 2)]
    assert list(idx) == ["c"] and idx.bytes == 30


def test_take_oldest_passes_over_held_entries_and_keeps_their_place() -> None:
    idx = _index()
    assert idx.take_oldest(5, lambda k, v: k == "a") == [("b", 2)]
    assert list(idx) == ["a", "c"] and idx.bytes == 40


def test_take_oldest_gives_what_there_is_when_not_enough_is_unheld() -> None:
    idx = _index()
    assert idx.take_oldest(1000, lambda k, v: v == 2) == [("a", 1), ("c", 3)]
    assert list(idx) == ["b"] and idx.bytes == 20
    assert idx.take_oldest(1, lambda k, v: True) == [] and list(idx) == ["b"]


def test_take_oldest_of_nothing_removes_nothing() -> None:
    idx = _index()
    assert idx.take_oldest(0) == [] and idx.take_oldest(-5) == [] and len(idx) == 3
