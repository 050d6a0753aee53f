"""The CPU tier: an LRU (or FIFO) index over the manager's memory pool.

Besides the async backend interface it implements :class:`~lmcache_async.tiers.PoolTier`
(the caller-thread surface the StorageManager uses without a loop hop: :meth:`lookup`,
:meth:`contains_nowait`, :meth:`prefix_len`, :meth:`allocate`, :meth:`insert`,
:meth:`remove_nowait`, ...). All of it is thread-safe under one index lock; the lock order is
index -> allocator, and no copy happens under the lock.

The index (:class:`~lmcache_async.lru.LruIndex`, by block bytes) holds one reference per
entry. An entry with any other reference (a reader, an in-flight write-through, a lease) is
*held*: eviction passes it over and frees only what nobody else holds. An entry whose block was
freed behind the index's back (a caller released its reference twice, giving back the index's)
is never served: the next lookup finds it released, drops it and counts ``over_released``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_async.errors import ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.lru import LruIndex
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.tiers import Allocate, BackendContext, RemovalReason, StorageBackend

__all__ = ["CPUBackend", "create"]

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)


class CPUBackend(StorageBackend):
    """LRU/FIFO over a :class:`PoolAllocator`; see the module docstring for the contract."""

    name = "cpu"

    def __init__(
        self,
        pool: PoolAllocator,
        policy: str = "LRU",
        on_evict: Callable[[CacheEngineKey], None] | None = None,
    ) -> None:
        if policy not in ("LRU", "FIFO"):
            raise ValueError(f"policy must be 'LRU' or 'FIFO', got {policy!r}")
        self.pool = pool
        self._lru = policy == "LRU"
        self._index: LruIndex[CacheEngineKey, MemoryObj] = LruIndex()  # sizes: block bytes
        self._keys = self._index.keys()  # live view: lock-free presence in one dict lookup
        self._lock = threading.Lock()
        self._closed = False
        self._on_evict = on_evict
        self.evictions = 0
        #: Entries found released behind the index's back (dropped; a miss each).
        self.over_released = 0

    @property
    def bytes(self) -> int:
        """Pool bytes held by the indexed entries (block sizes)."""
        return self._index.bytes

    @property
    def max_entry_bytes(self) -> int:
        """The pool's capacity: the largest payload an empty pool can hold (no header here)."""
        return self.pool.capacity

    def can_ever_hold(self, nbytes: int) -> bool:
        """True when an entry of ``nbytes`` payload bytes fits into the empty pool."""
        return self.pool.can_ever_fit(nbytes)

    # ---- declared capabilities -------------------------------------------------------------------
    def as_pool(self) -> CPUBackend:
        return self

    def as_local(self) -> CPUBackend:
        return self

    @property
    def reports_removals(self) -> bool:
        """Evictions, removals and clears are reported (:meth:`report_removed`)."""
        return True

    # ---- synchronous surface (any thread) ------------------------------------------------------
    def lookup(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry with one more reference for the caller (touching it under LRU), or None."""
        with self._lock:
            obj = self._index.lookup(key, self._lru)
            if obj is None:
                return None
            if obj.try_ref_count_up():
                return obj
            self._index.pop(key)  # its block was freed under us: never serve it
            self.over_released += 1
        _log.warning("cpu tier: entry %s was released once too often by a caller; dropped (a miss)", key)
        self.report_removed([key], RemovalReason.DAMAGED)
        return None

    def lookup_many(self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None) -> list[MemoryObj | None]:
        """:meth:`lookup` of each key (the caller owns one reference of each entry returned);
        ``alloc`` is not used (the entries are pool blocks already)."""
        return [self.lookup(k) for k in keys]

    def contains_nowait(self, key: CacheEngineKey) -> bool:
        """Presence without touching the entry (lock-free, one dict lookup)."""
        return key in self._keys

    def __contains__(self, key: object) -> bool:
        """Presence, lock-free (one dict lookup); see :class:`~lmcache_async.tiers.PoolTier`."""
        return key in self._keys

    def prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` are present."""
        idx = self._keys
        with self._lock:
            n = 0
            for k in keys:
                if k not in idx:
                    break
                n += 1
            return n

    def present_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of each key."""
        idx = self._keys
        with self._lock:
            return [k in idx for k in keys]

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Mark ``keys`` as recently used (LRU only)."""
        if not self._lru:
            return
        with self._lock:
            touch = self._index.touch
            for k in keys:
                touch(k)

    def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        *,
        evict: bool = True,
        protect: frozenset[CacheEngineKey] | set[CacheEngineKey] | None = None,
    ) -> MemoryObj | None:
        """A pool block, evicting entries nobody holds when needed; None when it cannot fit.

        Entries in ``protect`` are never evicted by this call. Never waits.
        """
        obj = self.pool.allocate(shape, dtype, fmt)
        if obj is not None or not evict:
            return obj
        n = dtype.itemsize
        for d in shape:
            n *= d
        if not self.pool.can_ever_fit(n):
            return None
        held = _held if not protect else _held_or_protected(protect)
        with self._lock:
            while True:
                victims = self._index.take_oldest(n, held)
                if not victims:
                    return self.pool.allocate(shape, dtype, fmt)
                self._dropped_locked(victims)
                obj = self.pool.allocate(shape, dtype, fmt)
                if obj is not None:
                    return obj

    def _dropped_locked(self, victims: list[tuple[CacheEngineKey, MemoryObj]]) -> None:
        """Release the index's reference of entries just taken out of the index; under the lock."""
        cb = self._on_evict
        for k, o in victims:
            self.evictions += 1
            o.try_ref_count_down()  # False: freed already by a caller's extra release
            if cb is not None:
                cb(k)
        self.report_removed([k for k, _ in victims], RemovalReason.EVICTED)

    def insert(self, key: CacheEngineKey, obj: MemoryObj, extra_refs: int = 0) -> MemoryObj | None:
        """Index ``obj`` (a block of this pool) under ``key``; the caller's reference becomes
        the index's. ``extra_refs`` more references are taken atomically (for write-through).

        Returns None when inserted; when the key is already present returns the existing entry
        (nothing changes and the caller keeps its reference to ``obj``). Raises
        :class:`ManagerClosedError` once the tier is closed (the caller keeps its reference).
        """
        if obj.allocator is not self.pool:
            raise ValueError("obj must be allocated from this tier's pool")
        with self._lock:
            if self._closed:  # a put that raced the manager's close: the caller keeps obj
                raise ManagerClosedError("the CPU tier is closed")
            existing = self._index.get(key)
            if existing is not None:
                return existing
            for _ in range(extra_refs):  # nobody else sees obj before it is indexed
                obj.ref_count_up()
            self._index.put(key, obj, obj.size)
            return None

    def remove_nowait(self, key: CacheEngineKey) -> bool:
        """Drop the entry; readers keep their references (the block is freed after them)."""
        with self._lock:
            obj = self._index.pop(key)
            if obj is None:
                return False
        obj.try_ref_count_down()
        self.report_removed([key], RemovalReason.DELETED)
        return True

    def clear_nowait(self) -> None:
        """Drop every entry (reported as deleted)."""
        self._drop_all(report=True)

    def _drop_all(self, report: bool) -> None:
        with self._lock:
            keys = list(self._index.keys())
            objs = list(self._index.values())
            self._index.clear()
        for o in objs:
            o.try_ref_count_down()
        if report:
            self.report_removed(keys, RemovalReason.DELETED)

    def __len__(self) -> int:
        return len(self._index)

    def keys_snapshot(self) -> list[CacheEngineKey]:
        """The keys present now, least recently used first."""
        with self._lock:
            return list(self._index)

    # ---- async backend interface ---------------------------------------------------------------
    def put_nowait(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Store ``obj`` (borrowed): indexed directly when it is a block of this pool, else copied."""
        if key in self._keys:
            return True
        if obj.allocator is self.pool:
            obj.ref_count_up()
            mine = obj
        else:
            got = self.allocate(obj.shape, obj.dtype, obj.fmt)
            if got is None:
                return False
            got.tensor.copy_(obj.tensor)
            mine = got
        try:
            existing = self.insert(key, mine)
        except ManagerClosedError:
            mine.ref_count_down()
            raise
        if existing is not None:
            mine.ref_count_down()
        return True

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return self.put_nowait(key, obj)

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return self.lookup(key)

    async def contains(self, key: CacheEngineKey) -> bool:
        return self.contains_nowait(key)

    async def remove(self, key: CacheEngineKey) -> bool:
        return self.remove_nowait(key)

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return self.present_flags(keys)

    async def clear(self) -> None:
        self.clear_nowait()

    def close_nowait(self) -> None:
        """Drop every entry and refuse inserts from now on. Idempotent; any thread."""
        with self._lock:
            self._closed = True
        self._drop_all(report=False)  # closing is no removal a listener must hear of

    async def close(self) -> None:
        self.close_nowait()

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._index),
            "bytes": self._index.bytes,
            "evictions": self.evictions,
            "over_released": self.over_released,
        }


def _held(_key: CacheEngineKey, obj: MemoryObj) -> bool:
    """Not evictable: someone besides the index holds a reference (a reader, a write-through).
    An entry with no reference left (freed by a caller's extra release) is evictable."""
    return obj.get_ref_count() > 1


def _held_or_protected(
    protect: frozenset[CacheEngineKey] | set[CacheEngineKey],
) -> Callable[[CacheEngineKey, MemoryObj], bool]:
    """:func:`_held`, and every key of ``protect`` besides."""

    def held(key: CacheEngineKey, obj: MemoryObj) -> bool:
        return obj.get_ref_count() > 1 or key in protect

    return held


def create(ctx: BackendContext) -> CPUBackend | None:
    """Registry factory: a CPU tier over the manager's pool (None without a pool)."""
    if ctx.pool is None:
        return None
    return CPUBackend(ctx.pool, ctx.config.cache_policy, ctx.on_evict)
