"""The CPU tier: an LRU (or FIFO) index over the manager's memory pool.

Besides the async backend interface it implements :class:`~lmcache_async.backend.PoolTier`
(the caller-thread surface the StorageManager uses without a loop hop: :meth:`lookup`,
:meth:`contains_nowait`, :meth:`prefix_len`, :meth:`allocate`, :meth:`insert`,
:meth:`remove_nowait`, ...). All of it is thread-safe under one index lock; the lock order is
index -> allocator, and no copy happens under the lock.

The index holds one reference per entry. An entry with any other reference (a reader, an
in-flight write-through) is never evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_async.backend import Allocate, BackendContext, StorageBackend
from lmcache_async.errors import ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator


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
        self._index: OrderedDict[CacheEngineKey, MemoryObj] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._on_evict = on_evict
        self.bytes = 0
        self.evictions = 0

    @property
    def max_entry_bytes(self) -> int:
        """The pool's capacity: the largest payload an empty pool can hold (no header here)."""
        return self.pool.capacity

    def can_ever_hold(self, nbytes: int) -> bool:
        """True when an entry of ``nbytes`` payload bytes fits into the empty pool."""
        return self.pool.can_ever_fit(nbytes)

    # ---- synchronous surface (any thread) ------------------------------------------------------
    def lookup(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry with one more reference for the caller (touching it under LRU), or None."""
        with self._lock:
            obj = self._index.get(key)
            if obj is None:
                return None
            obj.ref_count_up()
            if self._lru:
                self._index.move_to_end(key)
            return obj

    def contains_nowait(self, key: CacheEngineKey) -> bool:
        """Presence without touching the entry."""
        return key in self._index

    def __contains__(self, key: object) -> bool:
        """Presence, lock-free (one dict lookup); see :class:`~lmcache_async.backend.PoolTier`."""
        return key in self._index

    def prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` are present."""
        idx = self._index
        with self._lock:
            n = 0
            for k in keys:
                if k not in idx:
                    break
                n += 1
            return n

    def present_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of each key."""
        idx = self._index
        with self._lock:
            return [k in idx for k in keys]

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Mark ``keys`` as recently used (LRU only)."""
        if not self._lru:
            return
        with self._lock:
            for k in keys:
                if k in self._index:
                    self._index.move_to_end(k)

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
        with self._lock:
            while True:
                victims = self._pick_victims(n, protect)
                if not victims:
                    return self.pool.allocate(shape, dtype, fmt)
                self._drop_locked(victims)
                obj = self.pool.allocate(shape, dtype, fmt)
                if obj is not None:
                    return obj

    def _pick_victims(
        self, need: int, protect: frozenset[CacheEngineKey] | set[CacheEngineKey] | None
    ) -> list[tuple[CacheEngineKey, MemoryObj]]:
        out: list[tuple[CacheEngineKey, MemoryObj]] = []
        got = 0
        for k, o in self._index.items():
            if o.get_ref_count() == 1 and (protect is None or k not in protect):
                out.append((k, o))
                got += o.size
                if got >= need:
                    break
        return out

    def _drop_locked(self, victims: list[tuple[CacheEngineKey, MemoryObj]]) -> None:
        cb = self._on_evict
        for k, o in victims:
            del self._index[k]
            self.bytes -= o.size
            self.evictions += 1
            o.ref_count_down()
            if cb is not None:
                cb(k)

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
            self._index[key] = obj
            self.bytes += obj.size
            return None

    def remove_nowait(self, key: CacheEngineKey) -> bool:
        """Drop the entry; readers keep their references (the block is freed after them)."""
        with self._lock:
            obj = self._index.pop(key, None)
            if obj is None:
                return False
            self.bytes -= obj.size
        obj.ref_count_down()
        return True

    def clear_nowait(self) -> None:
        """Drop every entry."""
        with self._lock:
            objs = list(self._index.values())
            self._index.clear()
            self.bytes = 0
        for o in objs:
            o.ref_count_down()

    def __len__(self) -> int:
        return len(self._index)

    def keys_snapshot(self) -> list[CacheEngineKey]:
        """The keys present now, least recently used first."""
        with self._lock:
            return list(self._index)

    # ---- async backend interface ---------------------------------------------------------------
    def put_nowait(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Store ``obj`` (borrowed): indexed directly when it is a block of this pool, else copied."""
        if key in self._index:
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
        self.clear_nowait()

    async def close(self) -> None:
        self.close_nowait()

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._index), "bytes": self.bytes, "evictions": self.evictions}


def create(ctx: BackendContext) -> CPUBackend | None:
    """Registry factory: a CPU tier over the manager's pool (None without a pool)."""
    if ctx.pool is None:
        return None
    return CPUBackend(ctx.pool, ctx.config.cache_policy, ctx.on_evict)
