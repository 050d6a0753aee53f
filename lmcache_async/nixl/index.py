"""The ``nixl`` tier's index and byte budget: which keys it holds, where, and how many bytes.

Loop-thread only: every method here is called on the tier's event loop (``contains_nowait``
reads :meth:`NixlIndex.__contains__` from a caller thread: one dict lookup, atomic under the GIL). Nothing
here does I/O; deciding what a removal does to storage is the backend's job.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from lmcache_async.keys import CacheEngineKey
from lmcache_async.lru import LruIndex
from lmcache_async.nixl.transfer import EntryMeta

__all__ = ["Entry", "NixlCounters", "NixlIndex"]


@dataclass
class Entry:
    """One stored record: its metadata, where it lives (file stem, slot number or object name),
    how many reads are in flight on it, and whether it has left the index."""

    meta: EntryMeta
    location: str | int
    readers: int = 0
    removed: bool = False

    @property
    def size(self) -> int:
        """Record bytes, header included (what the budget counts)."""
        return self.meta.total_len


@dataclass
class NixlCounters:
    """The tier's monotonic counters (``stats()``)."""

    writes: int = 0
    write_failures: int = 0
    reads: int = 0
    read_failures: int = 0
    corrupt: int = 0
    foreign_key: int = 0
    io_errors: int = 0
    evictions: int = 0
    too_large: int = 0
    no_space: int = 0
    no_buffer: int = 0
    bounced: int = 0
    staged: int = 0
    scanned: int = 0
    reaped: int = 0
    stuck: int = 0
    quarantined_bytes: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """Every counter by name (``extra`` not included)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}


class NixlIndex:
    """Keys → :class:`Entry` in eviction order (oldest first), with the bytes they hold.

    ``capacity`` is the byte budget; ``lru`` makes a read move its entry to the young end (else
    the order is insertion order: FIFO). ``reserved`` counts bytes of writes in flight, which the
    budget includes. ``free_slots`` is the slot layout's list of unused slots (empty otherwise).
    The order and byte count are kept by the shared :class:`~lmcache_async.lru.LruIndex`; an
    entry being read is held (never an eviction victim).
    """

    def __init__(self, capacity: int, lru: bool) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity!r}")
        self.capacity = capacity
        self.lru = lru
        self._entries: LruIndex[CacheEngineKey, Entry] = LruIndex()
        self.reserved = 0
        self.free_slots: list[int] = []

    @property
    def bytes(self) -> int:
        """Record bytes of the indexed entries (without :attr:`reserved`)."""
        return self._entries.bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[CacheEngineKey]:
        return iter(self._entries)

    def __getitem__(self, key: CacheEngineKey) -> Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def values(self) -> Iterator[Entry]:
        """The entries, oldest first."""
        return self._entries.values()

    def items(self) -> list[tuple[CacheEngineKey, Entry]]:
        """``(key, entry)`` pairs, oldest first (a list: callers remove while they walk it)."""
        return list(self._entries.items())

    def get(self, key: CacheEngineKey) -> Entry | None:
        """The entry of ``key`` (None: not held); does not change the eviction order."""
        return self._entries.get(key)

    def begin_read(self, key: CacheEngineKey) -> Entry | None:
        """The entry of ``key`` with one more reader (it is not evicted until :meth:`end_read`),
        moved to the young end under LRU; None when ``key`` is not held."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.lru:
            self._entries.touch(key)
        entry.readers += 1
        return entry

    @staticmethod
    def end_read(entry: Entry) -> bool:
        """One reader of ``entry`` is done; True when it left the index and nobody reads it any
        more (its storage may go now)."""
        entry.readers -= 1
        return entry.removed and entry.readers == 0

    def add(self, key: CacheEngineKey, entry: Entry) -> Entry | None:
        """Index ``entry`` as the youngest; returns the entry it replaced (already unaccounted
        and out of the index, not marked removed), None when ``key`` was new."""
        return self._entries.put(key, entry, entry.size)

    def discard(self, key: CacheEngineKey, entry: Entry) -> bool:
        """Take ``entry`` out of the index and the budget and mark it removed. False when it was
        removed already (nothing changes)."""
        if entry.removed:
            return False
        if self._entries.get(key) is entry:
            self._entries.pop(key)
        entry.removed = True
        return True

    def fits(self, size: int) -> bool:
        """``size`` more bytes fit in the budget beside what is held and reserved."""
        return self.bytes + self.reserved + size <= self.capacity

    def oldest_unread(self) -> tuple[CacheEngineKey, Entry] | None:
        """The next eviction victim: the oldest entry nobody reads (None: every entry is read)."""
        return self._entries.oldest(_being_read)

    def locations(self) -> set[str | int]:
        """Where the indexed entries live."""
        return {e.location for e in self._entries.values()}


def _being_read(_key: CacheEngineKey, entry: Entry) -> bool:
    return entry.readers > 0
