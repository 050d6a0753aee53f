"""An in-process lower tier for exercising the manager's tier logic (write-through,
promotion, timeouts, circuit breaker). Real tiers have their own suites."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import UNKNOWN, Allocate, BackendContext, CannotTell, StorageBackend, register_backend


class MemBackend(StorageBackend):
    """Stores byte copies in a dict. ``mode``: "ok", "fail" (raise), "hang" (never answer)."""

    name = "testmem"
    instances: list[MemBackend] = []

    def __init__(self, ctx: BackendContext, remote: bool = False) -> None:
        self.ctx = ctx
        self.data: dict[CacheEngineKey, tuple[tuple[int, ...], Any, Any, bytes]] = {}
        self.mode = "ok"
        self.delay = 0.0
        self.fail_keys: set[CacheEngineKey] = set()  # get of these raises
        self.puts = 0
        self._remote = remote
        self.closed = False
        MemBackend.instances.append(self)

    @property
    def is_remote(self) -> bool:
        return self._remote

    async def _gate(self) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.mode == "fail":
            raise ConnectionError("injected failure")
        if self.mode == "hang":
            await asyncio.sleep(3600)

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        await self._gate()
        if key not in self.data:
            self.data[key] = (obj.shape, obj.dtype, obj.fmt, bytes(obj.byte_view()))
            self.puts += 1
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        await self._gate()
        if key in self.fail_keys:
            raise OSError("injected read failure")
        rec = self.data.get(key)
        if rec is None:
            return None
        shape, dtype, fmt, payload = rec
        obj = (alloc or self.ctx.staging)(shape, dtype, fmt)
        if obj is None:
            return None
        obj.byte_view()[:] = payload
        return obj

    async def contains(self, key: CacheEngineKey) -> bool:
        await self._gate()
        return key in self.data

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """Like a local tier's in-memory index: answered here unless the tier plays a remote
        one or is delayed/failing (then the manager asks :meth:`contains` on its loop)."""
        if self._remote or self.mode != "ok" or self.delay:
            return UNKNOWN
        return key in self.data

    async def remove(self, key: CacheEngineKey) -> bool:
        await self._gate()
        return self.data.pop(key, None) is not None

    async def clear(self) -> None:
        await self._gate()
        self.data.clear()

    async def close(self) -> None:
        self.closed = True

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self.data), "bytes": sum(len(r[3]) for r in self.data.values())}


def register() -> None:
    register_backend("testmem", lambda ctx: MemBackend(ctx), replace=True)
    register_backend("testremote", lambda ctx: _named(MemBackend(ctx, remote=True), "testremote"), replace=True)


def _named(b: MemBackend, name: str) -> MemBackend:
    b.name = name
    return b


def last() -> MemBackend:
    return MemBackend.instances[-1]


def all_named(names: Sequence[str]) -> list[MemBackend]:
    return [b for b in MemBackend.instances if b.name in names]
