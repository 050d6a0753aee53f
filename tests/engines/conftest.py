"""Fixtures for the KV engine and hidden-state store tests: engines that always close, and a
small in-memory lower tier whose answers can be made to fail (registered by name)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from engines._data import CHUNK

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, register_backend
from lmcache_async.engines.kv import LMCacheEngine
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import Allocate, BackendContext, StorageBackend

EngineFactory = Callable[..., LMCacheEngine]


@pytest.fixture
def make_engine(metadata: LMCacheEngineMetadata) -> Iterator[EngineFactory]:
    """Engine factory (chunk_size 16, 16 MiB KV pool, HS enabled with 16 MiB unless overridden);
    every engine is closed at the end of the test."""
    made: list[LMCacheEngine] = []

    def make(**overrides: Any) -> LMCacheEngine:
        base: dict[str, Any] = {
            "chunk_size": CHUNK,
            "max_local_cpu_size": 1 / 64,
            "staging_size": 1 / 256,
            "enable_hidden_state_cache": True,
            "max_hidden_state_cpu_size": 1 / 64,
            "blocking_timeout_secs": 10,
        }
        base.update(overrides)
        eng = LMCacheEngine(LMCacheEngineConfig.from_defaults(**base), metadata)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()
    gc.collect()


class MemoryTier(StorageBackend):
    """A lower tier holding copies in process memory; ``failing`` makes every call raise (as a
    remote store that went away would), which the manager turns into "unknown"."""

    name = "test-memory"

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.failing = False
        self.data: dict[CacheEngineKey, tuple[torch.Tensor, Any]] = {}

    def _check(self) -> None:
        if self.failing:
            raise ConnectionError("test tier is down")

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        self._check()
        self.data.setdefault(key, (obj.tensor.clone(), obj.fmt))
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        self._check()
        item = self.data.get(key)
        if item is None:
            return None
        t, fmt = item
        obj = (alloc or self.ctx.staging)(tuple(t.shape), t.dtype, fmt)
        if obj is None:
            return None
        obj.tensor.copy_(t)
        return obj

    async def contains(self, key: CacheEngineKey) -> bool:
        self._check()
        return key in self.data

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        self._check()
        return [k in self.data for k in keys]

    async def remove(self, key: CacheEngineKey) -> bool:
        self._check()
        return self.data.pop(key, None) is not None

    async def clear(self) -> None:
        self.data.clear()


@pytest.fixture
def memory_tier() -> Iterator[list[MemoryTier]]:
    """Registers the ``test-memory`` tier; the list receives every instance built."""
    built: list[MemoryTier] = []

    def create(ctx: BackendContext) -> MemoryTier:
        tier = MemoryTier(ctx)
        built.append(tier)
        return tier

    register_backend(MemoryTier.name, create, replace=True)
    yield built
