"""One LRU-by-bytes index: keys in use order with the bytes each holds, and eviction that skips
what is held.

Tiers keep their own notion of an entry (a file size, an index entry with readers, a pool block)
as the value; the index keeps the order (oldest first), each entry's byte size and their total,
and answers "which entry goes next" under a caller's *held* predicate (an entry being read, or
pinned, is never a victim). It does no I/O and frees nothing: the caller deletes what the index
hands out.

Not thread-safe: the owner serialises calls (its index lock, or its event loop).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, KeysView
from typing import Generic, TypeVar

__all__ = ["Held", "LruIndex"]

K = TypeVar("K")
V = TypeVar("V")

Held = Callable[[K, V], bool]
"""``held(key, value)``: True when the entry must not be evicted now. It must not change the
index it is asked about."""


class LruIndex(Generic[K, V]):
    """Keys → values with a byte size each, least recently used first.

    :meth:`put`, :meth:`touch` and :meth:`lookup` make an entry the youngest; a FIFO owner simply
    never touches. ``len()``, ``in``, ``index[key]``, iteration (oldest first) and :attr:`bytes`
    (the sum of the sizes) are O(1) per step.
    """

    __slots__ = ("_bytes", "_entries")

    def __init__(self, items: Iterable[tuple[K, V, int]] = ()) -> None:
        self._entries: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._bytes = 0
        for key, value, size in items:
            self.put(key, value, size)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __getitem__(self, key: K) -> V:
        """The value of ``key``; KeyError when absent. The order does not change."""
        return self._entries[key][0]

    @property
    def bytes(self) -> int:
        """The sum of the sizes of every entry."""
        return self._bytes

    def keys(self) -> KeysView[K]:
        """A live, read-only view of the keys, oldest first; ``key in view`` is one dict lookup.

        For an owner's lock-free presence checks: a reader that skips the owner's lock sees the
        keys as of some moment (a hint), never enough to decide what to free."""
        return self._entries.keys()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (None: absent); the order does not change."""
        item = self._entries.get(key)
        return None if item is None else item[0]

    def lookup(self, key: K, touch: bool = True) -> V | None:
        """The value of ``key`` (None: absent), made the youngest entry when ``touch``."""
        item = self._entries.get(key)
        if item is None:
            return None
        if touch:
            self._entries.move_to_end(key)
        return item[0]

    def size(self, key: K) -> int | None:
        """The byte size of ``key`` (None: absent)."""
        item = self._entries.get(key)
        return None if item is None else item[1]

    def items(self) -> Iterator[tuple[K, V]]:
        """``(key, value)`` pairs, oldest first."""
        return ((k, v) for k, (v, _s) in self._entries.items())

    def values(self) -> Iterator[V]:
        """The values, oldest first."""
        return (v for v, _s in self._entries.values())

    def put(self, key: K, value: V, size: int) -> V | None:
        """Index ``key`` as the youngest entry holding ``size`` bytes; returns the value it
        replaced (None when ``key`` was new). ``size`` must be an int >= 0 (else ValueError)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[key] = (value, size)
        self._bytes += size
        return None if old is None else old[0]

    def touch(self, key: K) -> bool:
        """Make ``key`` the youngest entry; False when it is absent."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value, None when it was absent."""
        item = self._entries.pop(key, None)
        if item is None:
            return None
        self._bytes -= item[1]
        return item[0]

    def clear(self) -> None:
        """Remove every entry."""
        self._entries.clear()
        self._bytes = 0

    def oldest(self, held: Held[K, V] | None = None) -> tuple[K, V] | None:
        """The next victim: the oldest entry ``held`` does not hold (None: there is none). The
        index does not change."""
        for key, (value, _size) in self._entries.items():
            if held is None or not held(key, value):
                return key, value
        return None

    def pop_oldest(self, held: Held[K, V] | None = None) -> tuple[K, V] | None:
        """Remove and return the next victim (see :meth:`oldest`); None when every entry is held."""
        victim = self.oldest(held)
        if victim is not None:
            self.pop(victim[0])
        return victim

    def take_oldest(self, need: int, held: Held[K, V] | None = None) -> list[tuple[K, V]]:
        """Remove the oldest unheld entries until their sizes add up to at least ``need`` bytes
        (or no unheld entry is left); what was removed, oldest first (the caller frees it).

        For owners whose room is not a byte count (a pool allocator, where freed blocks may not
        be adjacent): they free what this returns, try again, and ask for more when it did not
        fit. ``need`` <= 0 removes nothing. One pass over the index."""
        out: list[tuple[K, V]] = []
        if need <= 0:
            return out
        got = 0
        for key, (value, size) in self._entries.items():
            if held is None or not held(key, value):
                out.append((key, value))
                got += size
                if got >= need:
                    break
        for key, _value in out:
            self._bytes -= self._entries.pop(key)[1]
        return out

    def evict(self, need: int, capacity: int, held: Held[K, V] | None = None) -> list[tuple[K, V]]:
        """Remove the oldest unheld entries until ``need`` more bytes fit in ``capacity``.

        Returns what was removed, oldest first (the caller frees it). When even that is not
        enough, the entries removed so far stay removed and the caller sees that
        ``bytes + need > capacity`` still holds.
        """
        out: list[tuple[K, V]] = []
        while self._bytes + need > capacity:
            victim = self.pop_oldest(held)
            if victim is None:
                break
            out.append(victim)
        return out
