"""The shared LRU-by-bytes index (:mod:`lmcache_async.lru`)."""

from __future__ import annotations

import pytest

from lmcache_async.lru import LruIndex


def _index() -> LruIndex[str, int]:
    return LruIndex([("a", 1, 10), ("b", 2, 20), ("c", 3, 30)])


def test_entries_are_kept_oldest_first_with_their_bytes() -> None:
    idx = _index()
    assert list(idx) == ["a", "b", "c"] and len(idx) == 3 and idx.bytes == 60
    assert idx.get("b") == 2 and idx.size("b") == 20 and "b" in idx
    assert idx.get("z") is None and idx.size("z") is None and "z" not in idx
    assert list(idx.items()) == [("a", 1), ("b", 2), ("c", 3)] and list(idx.values()) == [1, 2, 3]


def test_touch_makes_an_entry_the_youngest() -> None:
    idx = _index()
    assert idx.touch("a")
    assert list(idx) == ["b", "c", "a"]
    assert not idx.touch("z")


def test_get_does_not_change_the_order() -> None:
    idx = _index()
    idx.get("a")
    assert list(idx) == ["a", "b", "c"]


def test_put_of_a_present_key_replaces_it_as_the_youngest_and_reaccounts() -> None:
    idx = _index()
    assert idx.put("a", 9, 5) == 1
    assert list(idx) == ["b", "c", "a"] and idx.get("a") == 9 and idx.bytes == 55
    assert idx.put("d", 4, 0) is None and idx.bytes == 55


def test_pop_and_clear_keep_the_total_right() -> None:
    idx = _index()
    assert idx.pop("b") == 2 and idx.bytes == 40
    assert idx.pop("b") is None and idx.bytes == 40
    idx.clear()
    assert len(idx) == 0 and idx.bytes == 0 and idx.oldest() is None


def test_the_oldest_unheld_entry_is_the_next_victim() -> None:
    idx = _index()
    assert idx.oldest() == ("a", 1)
    assert idx.oldest(lambda k, v: k == "a") == ("b", 2)
    assert idx.oldest(lambda k, v: True) is None
    assert len(idx) == 3  # looking evicts nothing
    assert idx.pop_oldest(lambda k, v: v < 3) == ("c", 3)
    assert list(idx) == ["a", "b"] and idx.bytes == 30


def test_evict_frees_just_enough_and_never_a_held_entry() -> None:
    idx = _index()
    assert idx.evict(need=15, capacity=60, held=lambda k, v: k == "a") == [("b", 2)]
    assert list(idx) == ["a", "c"] and idx.bytes == 40
    assert idx.evict(need=0, capacity=60) == []


def test_evict_that_cannot_make_room_leaves_the_shortfall_visible() -> None:
    idx = _index()
    removed = idx.evict(need=100, capacity=60, held=lambda k, v: k == "c")
    assert removed == [("a", 1), ("b", 2)]
    assert list(idx) == ["c"] and idx.bytes + 100 > 60


@pytest.mark.parametrize("size", [-1, 1.5, True, "3"])
def test_a_size_that_is_not_a_byte_count_is_a_value_error(size: object) -> None:
    with pytest.raises(ValueError, match="size"):
        LruIndex[str, int]().put("a", 1, size)  # type: ignore[arg-type]
