"""A fault-injecting wrapper around a real backend, for the manager conformance class.

:class:`FaultyTier` forwards every call to the backend it wraps until a test switches its
:attr:`~FaultyTier.mode`: ``"fail"`` makes every coroutine raise ``ConnectionError`` (a server
that went away), ``"hang"`` makes every coroutine wait forever (a peer that stopped answering;
the wait is cancellable, as the manager's timeout needs). ``close`` is always forwarded, so a
test can end in any mode. The wrapper declares what the wrapped tier declares of the capabilities
it can put faults in front of: a :class:`~lmcache_async.tiers.DirectReader` (the disk tier)
stays one, its blocking ``read_into_many`` forwarded in ``"ok"`` mode and raising
``ConnectionError`` otherwise; removal reports are forwarded under the wrapper's name (a caller-thread read cannot
hang-and-be-cancelled; it fails). Caller-thread capabilities without a fault switch (local
reads, direct puts, leases) are not declared.
The wrapped backend is still the one under test: in ``"ok"`` mode the wrapper adds nothing but
its name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.read_sinks import ReadSink
from lmcache_async.tiers import UNKNOWN, Allocate, CannotTell, DirectReader, RemovalListener, StorageBackend

__all__ = ["FaultMode", "FaultyTier"]

FaultMode = Literal["ok", "fail", "hang"]


class FaultyTier(StorageBackend):
    """``inner`` under the registry name ``name``, with injectable failures.

    Threads: like any backend (coroutines on the manager's loop; :meth:`contains_nowait` and
    :meth:`stats` on any thread). :attr:`mode` may be switched from any thread; calls already
    waiting in ``"hang"`` mode stay stuck until cancelled. Outside ``"ok"`` mode
    :meth:`contains_nowait` answers None (it cannot tell), so the manager asks the loop.
    """

    def __init__(self, inner: StorageBackend, name: str) -> None:
        if not isinstance(inner, StorageBackend):
            raise TypeError(f"inner must be a StorageBackend, got {type(inner).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.inner = inner
        self.name = name
        self.mode: FaultMode = "ok"
        self.injected = 0
        self._reader = inner.as_direct_reader()

    # ---- declared capabilities, forwarded ----------------------------------------------------
    def as_direct_reader(self) -> DirectReader | None:
        """The wrapped tier's direct reader behind the fault switch (None when it has none)."""
        return self if self._reader is not None else None

    def read_into_many(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """The wrapped tier's direct read in ``"ok"`` mode; ``ConnectionError`` otherwise."""
        if self.mode != "ok" or self._reader is None:
            self.injected += 1
            raise ConnectionError(f"{self.name}: injected failure")
        return self._reader.read_into_many(keys, sinks, prefix)

    @property
    def reports_removals(self) -> bool:
        return self.inner.reports_removals

    def bind_removals(self, listener: RemovalListener | None) -> None:
        """The wrapped tier's reports, under this wrapper's name."""
        super().bind_removals(listener)
        if listener is None:
            self.inner.bind_removals(None)
        else:
            self.inner.bind_removals(lambda _tier, keys, reason: listener(self.name, keys, reason))

    async def _gate(self) -> None:
        mode = self.mode
        if mode == "ok":
            return
        self.injected += 1
        if mode == "fail":
            raise ConnectionError(f"{self.name}: injected failure")
        await asyncio.Event().wait()  # "hang": only cancellation ends it

    # ---- capabilities, forwarded -----------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return self.inner.persistent

    @property
    def shared(self) -> bool:
        return self.inner.shared

    @property
    def supports_delete(self) -> bool:
        return self.inner.supports_delete

    @property
    def is_remote(self) -> bool:
        return self.inner.is_remote

    @property
    def max_entry_bytes(self) -> int | None:
        return self.inner.max_entry_bytes

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self._gate()
        await self.inner.start()

    async def flush(self) -> None:
        await self._gate()
        await self.inner.flush()

    async def close(self) -> None:
        await self.inner.close()

    # ---- operations ------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        await self._gate()
        return await self.inner.put(key, obj)

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        await self._gate()
        return await self.inner.get(key, alloc)

    async def contains(self, key: CacheEngineKey) -> bool:
        await self._gate()
        return await self.inner.contains(key)

    async def remove(self, key: CacheEngineKey) -> bool:
        await self._gate()
        return await self.inner.remove(key)

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        await self._gate()
        return await self.inner.batched_put(items)

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        await self._gate()
        return await self.inner.batched_get(keys, alloc)

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        await self._gate()
        return await self.inner.batched_contains(keys)

    async def clear(self) -> None:
        await self._gate()
        await self.inner.clear()

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        return self.inner.contains_nowait(key) if self.mode == "ok" else UNKNOWN

    def stats(self) -> dict[str, Any]:
        """The wrapped backend's figures plus ``injected`` (calls that met a fault)."""
        return {**self.inner.stats(), "injected": self.injected}
