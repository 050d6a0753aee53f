"""The in-memory reference backend: the smallest tier that honours every contract of
:mod:`lmcache_async.tiers`.

It is written from ``backend.py`` and this kit alone, so it doubles as the model a new tier
starts from (``docs`` has a "write your own tier" page built on it) and as a lower tier for
manager tests that need a real, fast one. Records live in a dict as immutable byte copies
together with their shape, dtype and memory format; nothing outlives the process
(``persistent`` and ``shared`` are False).

Register it for a :class:`~lmcache_async.storage_manager.StorageManager` with::

    from lmcache_async.tiers import register_backend
    from lmcache_async.testing.memory_backend import create

    register_backend("memory", create)
    # config: tier_order = ["cpu", "memory"]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.tiers import Allocate, BackendContext, StorageBackend

__all__ = ["InMemoryBackend", "StoredRecord", "create"]


@dataclass(frozen=True)
class StoredRecord:
    """One entry as the reference backend keeps it: an immutable copy of the payload."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    payload: bytes


def _check_key(key: object) -> CacheEngineKey:
    if not isinstance(key, CacheEngineKey):
        raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
    return key


class InMemoryBackend(StorageBackend):
    """A dict of byte copies, optionally bounded by ``capacity_bytes`` (payload bytes).

    ``name`` is the tier's identity: pass the name it is registered under when that is not
    ``"memory"``.

    Threads: the coroutines run on the owning manager's loop thread (or the test's loop);
    :meth:`contains_nowait`, :meth:`stats` and :meth:`snapshot` may be called from any thread —
    every access to the dict is under one lock, never held across an ``await``.

    A put that would exceed ``capacity_bytes`` is refused (False, counted as ``rejected``): the
    reference backend never evicts, so what it reports present stays present until removed.
    ``get`` reads into ``alloc`` (the context's staging allocator by default); when no buffer
    is available it is a miss, counted as ``alloc_failures``. The returned MemoryObj carries
    one reference the caller owns.
    """

    name = "memory"

    def __init__(self, ctx: BackendContext, *, capacity_bytes: int | None = None, name: str = "memory") -> None:
        if not isinstance(ctx, BackendContext):
            raise TypeError(f"ctx must be a BackendContext, got {type(ctx).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str (the registry name), got {name!r}")
        self.name = name
        if capacity_bytes is not None and (
            not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0
        ):
            raise ValueError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
        self._alloc = ctx.staging
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._records: dict[CacheEngineKey, StoredRecord] = {}
        self._bytes = 0
        self._closed = False
        self._counts = {"puts": 0, "hits": 0, "misses": 0, "removes": 0, "rejected": 0, "alloc_failures": 0}

    # ---- capabilities ------------------------------------------------------------------------
    @property
    def max_entry_bytes(self) -> int | None:
        """``capacity_bytes`` (records have no header here), None when unbounded."""
        return self._capacity

    # ---- core ----------------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Copy ``obj``'s payload; True when stored or already present, False when closed or
        over capacity. The caller's reference to ``obj`` is untouched."""
        _check_key(key)
        if not isinstance(obj, MemoryObj):
            raise TypeError(f"obj must be a MemoryObj, got {type(obj).__name__}")
        with self._lock:
            if self._closed:
                return False
            if key in self._records:
                return True
        # Copy outside the lock (a large copy must not stall callers of contains_nowait).
        record = StoredRecord(tuple(obj.shape), obj.dtype, obj.fmt, bytes(obj.byte_view()))
        with self._lock:
            if self._closed:
                return False
            if key in self._records:  # a concurrent put of the same key won
                return True
            if self._capacity is not None and self._bytes + len(record.payload) > self._capacity:
                self._counts["rejected"] += 1
                return False
            self._records[key] = record
            self._bytes += len(record.payload)
            self._counts["puts"] += 1
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        """A fresh buffer from ``alloc`` holding the entry (caller owns one reference), or None."""
        _check_key(key)
        with self._lock:
            record = None if self._closed else self._records.get(key)
            self._counts["hits" if record is not None else "misses"] += 1
        if record is None:
            return None
        obj = (alloc or self._alloc)(record.shape, record.dtype, record.fmt)
        if obj is None:
            with self._lock:
                self._counts["alloc_failures"] += 1
            return None
        obj.byte_view()[:] = record.payload
        return obj

    async def contains(self, key: CacheEngineKey) -> bool:
        """True when :meth:`get` would return the entry (given a buffer to read into)."""
        _check_key(key)
        with self._lock:
            return not self._closed and key in self._records

    async def remove(self, key: CacheEngineKey) -> bool:
        """Delete the entry; True when it was present. Readers keep the copies they got."""
        _check_key(key)
        with self._lock:
            record = self._records.pop(key, None)
            if record is None:
                return False
            self._bytes -= len(record.payload)
            self._counts["removes"] += 1
            return True

    async def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            self._records.clear()
            self._bytes = 0

    async def close(self) -> None:
        """Drop every entry; later calls are misses and refused puts."""
        with self._lock:
            self._closed = True
            self._records.clear()
            self._bytes = 0

    # ---- caller-thread answers ----------------------------------------------------------------
    def contains_nowait(self, key: CacheEngineKey) -> bool:
        """:meth:`contains`, answered on any thread (the dict is the whole truth here)."""
        _check_key(key)
        with self._lock:
            return not self._closed and key in self._records

    def stats(self) -> dict[str, Any]:
        """``entries``, ``bytes`` (payload bytes held) and the operation counters; any thread."""
        with self._lock:
            return {"entries": len(self._records), "bytes": self._bytes, **self._counts}

    def snapshot(self) -> dict[str, StoredRecord]:
        """Every record by key string (``CacheEngineKey.to_string()``): the medium itself, for
        conformance hooks that check what is stored without going through :meth:`get`."""
        with self._lock:
            return {k.to_string(): r for k, r in self._records.items()}


def create(ctx: BackendContext) -> InMemoryBackend:
    """Registry factory for the name ``"memory"`` (``register_backend("memory", create)``): an
    unbounded backend. Under another name, register ``lambda ctx: InMemoryBackend(ctx, name=...)``."""
    return InMemoryBackend(ctx)
