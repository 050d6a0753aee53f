"""An example third-party tier: entries kept as byte copies in a dict, bounded by its settings.

It is written against :mod:`lmcache_async.tiers.abc` alone and registered through the
``lmcache_async.backends`` entry-point group (see this package's ``pyproject.toml``), so a
configuration turns it on by name::

    tiers:
      example: {capacity_bytes: 1048576, label: shelf}
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.tiers import Allocate, BackendContext, RemovalReason, StorageBackend, TierSpec

__all__ = ["SPEC", "ExampleSettings", "ExampleTier", "create"]


class ExampleSettings(BaseModel):
    """The ``tiers.example`` section."""

    model_config = ConfigDict(extra="forbid")

    capacity_bytes: int = Field(64 << 20, gt=0, description="Payload bytes the tier holds at most.")
    label: str = Field("example", min_length=1, description="A name shown in the tier's figures.")


class ExampleTier(StorageBackend):
    """Byte copies in a dict; the oldest entry is evicted (and reported) to make room."""

    name = "example"

    def __init__(self, ctx: BackendContext, settings: ExampleSettings) -> None:
        self.settings = settings
        self._alloc = ctx.staging
        self._lock = threading.Lock()
        self._records: dict[CacheEngineKey, tuple[tuple[int, ...], torch.dtype, MemoryFormat, bytes]] = {}
        self._bytes = 0
        self.evictions = 0

    @property
    def max_entry_bytes(self) -> int:
        return self.settings.capacity_bytes

    @property
    def reports_removals(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        record = (tuple(obj.shape), obj.dtype, obj.fmt, bytes(obj.byte_view()))
        size = len(record[3])
        if size > self.settings.capacity_bytes:
            return False
        evicted: list[CacheEngineKey] = []
        with self._lock:
            if key in self._records:
                return True
            while self._bytes + size > self.settings.capacity_bytes:
                old = next(iter(self._records))
                self._bytes -= len(self._records.pop(old)[3])
                evicted.append(old)
            self._records[key] = record
            self._bytes += size
            self.evictions += len(evicted)
        self.report_removed(evicted, RemovalReason.EVICTED)
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        with self._lock:
            record = self._records.get(key)
        if record is None:
            return None
        obj = (alloc or self._alloc)(record[0], record[1], record[2])
        if obj is None:
            return None
        obj.byte_view()[:] = record[3]
        return obj

    async def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._records

    def contains_nowait(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._records

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        with self._lock:
            return [k in self._records for k in keys]

    async def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self._bytes -= len(record[3])
        if record is None:
            return False
        self.report_removed([key], RemovalReason.DELETED)
        return True

    async def clear(self) -> None:
        with self._lock:
            keys = list(self._records)
            self._records.clear()
            self._bytes = 0
        self.report_removed(keys, RemovalReason.DELETED)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": len(self._records),
                "bytes": self._bytes,
                "evictions": self.evictions,
                "capacity_bytes": self.settings.capacity_bytes,
            }


def create(ctx: BackendContext) -> ExampleTier:
    """The registry factory: the tier with its validated ``tiers.example`` settings."""
    settings = ctx.settings if isinstance(ctx.settings, ExampleSettings) else ExampleSettings()
    return ExampleTier(ctx, settings)


SPEC = TierSpec(factory=create, settings=ExampleSettings)
"""What the entry point names: the factory and the settings model (on whenever named)."""
