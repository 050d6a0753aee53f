"""Fixtures of the disk-tier tests: a backend factory bound to the test loop and helpers."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.disk.tier import DiskBackend
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator


@pytest.fixture
def pool() -> PoolAllocator:
    """Source blocks for the entries a test writes (not pre-touched)."""
    return PoolAllocator(32 << 20, name="disk-test-src", pretouch=False)


@pytest.fixture
def staging() -> Callable[[Sequence[int], torch.dtype, MemoryFormat], MemoryObj | None]:
    pool = PoolAllocator(64 << 20, name="disk-test-staging", pretouch=False)
    heap = HeapAllocator("disk-test-heap")

    def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return pool.allocate(shape, dtype, fmt) or heap.allocate(shape, dtype, fmt)

    return alloc


@pytest.fixture
async def make_disk(
    staging: Any,
) -> AsyncIterator[Callable[..., Any]]:
    """``await make_disk(root, budget_bytes=..., **kw)`` -> a started DiskBackend (closed at the end)."""
    executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-disk-test")
    made: list[DiskBackend] = []

    async def make(root: Path | str, budget_bytes: int = 1 << 30, *, ready: bool = True, **kw: Any) -> DiskBackend:
        be = DiskBackend(os.fspath(root), budget_bytes, executor=executor, staging=staging, **kw)
        made.append(be)
        await be.start()
        if ready:
            await be.wait_ready()
        return be

    yield make
    for be in made:
        await be.close()
    executor.shutdown(wait=True)
