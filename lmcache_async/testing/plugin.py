"""pytest plugin (entry point ``pytest11``): fixtures for the backend conformance suite.

``backend_context`` is a factory returning a :class:`~lmcache_async.tiers.BackendContext`
bound to the running test loop, with its own executor, a 64 MiB staging pool and a 64 MiB CPU
pool. A test class may define ``make_config(self) -> LMCacheEngineConfig`` to customise it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.tiers import BackendContext

__all__ = ["backend_context"]


@pytest.fixture
async def backend_context(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[], BackendContext]]:
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-test-io")
    staging = PoolAllocator(64 << 20, name="test-staging", pretouch=False)
    pool = PoolAllocator(64 << 20, name="test-pool", pretouch=False)
    heap = HeapAllocator("test-heap")
    inst = getattr(request, "instance", None)
    make_config = getattr(inst, "make_config", None)
    config = make_config() if make_config is not None else LMCacheEngineConfig()

    def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return staging.allocate(shape, dtype, fmt) or heap.allocate(shape, dtype, fmt)

    def factory() -> BackendContext:
        return BackendContext(
            config=config,
            metadata=LMCacheEngineMetadata("conformance"),
            cache_name="test",
            loop=loop,
            executor=executor,
            staging=alloc,
            staging_pool=staging,
            pool=pool,
        )

    yield factory
    executor.shutdown(wait=True)
