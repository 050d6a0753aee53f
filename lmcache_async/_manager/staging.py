"""Buffers outside the cache budget: where lower-tier reads land, and what carries a put that
skips the CPU tier down to the lower tiers.

Two sources: the preallocated staging pool (``staging_size`` GiB; absent when 0), and one-off heap
buffers for an entry the pool cannot take. A one-off buffer is handed out only when it leaves
the memory reserve free (``memory_reserve_size``, the same reserve the pools are sized against),
so a burst of large entries slows down instead of exhausting the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache_async.memory import (
    GiB,
    HeapAllocator,
    MemoryFormat,
    MemoryObj,
    PoolAllocator,
    gib_to_bytes,
    memory_available_bytes,
    payload_nbytes,
)

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig

__all__ = ["StagingArea", "default_reserve_bytes", "manager_memory"]


def default_reserve_bytes() -> int:
    """The memory kept free when ``memory_reserve_size`` is unset: the pools' rule (5% of the
    memory available now, at least 0.5 GiB, at most 2 GiB)."""
    return min(2 * GiB, max(GiB // 2, (memory_available_bytes() or 0) // 20))


class StagingArea:
    """The staging pool (``pool``, may be None) plus one-off buffers from ``heap``, kept within
    ``reserve_bytes`` of free memory.

    Any thread (the allocators are thread-safe). Every buffer returned carries one reference the
    caller owns. ``one_off_refused`` counts the one-off buffers refused for the memory reserve.
    """

    def __init__(self, pool: PoolAllocator | None, heap: HeapAllocator, reserve_bytes: int) -> None:
        self.pool = pool
        self.heap = heap
        self.reserve_bytes = reserve_bytes
        self.one_off_refused = 0

    def fits_memory(self, nbytes: int) -> bool:
        """True when a one-off buffer of ``nbytes`` leaves the memory reserve free; True where
        the available memory cannot be read."""
        avail = memory_available_bytes()
        return avail is None or nbytes <= avail - self.reserve_bytes

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """A buffer for a read: the staging pool first, a one-off buffer when it is full or too
        small; None when that buffer would not leave the memory reserve free (counted)."""
        if self.pool is not None:
            obj = self.pool.allocate(shape, dtype, fmt)
            if obj is not None:
                return obj
        if not self.fits_memory(payload_nbytes(shape, dtype)):
            self.one_off_refused += 1
            return None
        return self.heap.allocate(shape, dtype, fmt)

    def allocate_write(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat, nbytes: int
    ) -> MemoryObj | None:
        """A buffer carrying a write of ``nbytes`` to the lower tiers, or None right now.

        An entry the staging pool can hold waits for room there (None when it is full). A larger
        one gets a one-off buffer, bounded: at most one at a time beyond the staging size (reads
        aside), and never eating into the memory reserve (those refusals are counted)."""
        sp = self.pool
        if sp is not None and sp.can_ever_fit(nbytes):
            return sp.allocate(shape, dtype, fmt)
        heap_used = self.heap.used_bytes
        if heap_used and heap_used + nbytes > (sp.capacity if sp is not None else 0):
            return None
        if not self.fits_memory(nbytes):
            self.one_off_refused += 1
            return None
        return self.heap.allocate(shape, dtype, fmt)


def manager_memory(
    config: LMCacheEngineConfig, name: str, size_gib: float, size_key: str, wants_lower: bool
) -> tuple[PoolAllocator | None, PoolAllocator | None, StagingArea]:
    """The memory of the manager named ``name``: its CPU pool (``size_gib``, None without a CPU
    tier: ``local_cpu`` off, a size of 0 or a ``tier_order`` without ``cpu``), its staging pool
    (``staging_size``; only with lower tiers, ``wants_lower``, or no CPU pool) and the staging
    area over it. ``size_key`` names the pool's size key in messages."""
    reserve = None if config.memory_reserve_size is None else gib_to_bytes(config.memory_reserve_size)
    pool = None
    if config.local_cpu and size_gib > 0 and "cpu" in config.tier_order:
        pool = PoolAllocator(gib_to_bytes(size_gib), name=f"{name} CPU pool ({size_key})", reserve_bytes=reserve)
    staging_pool = None
    if (wants_lower or pool is None) and config.staging_size > 0:
        staging_pool = PoolAllocator(
            gib_to_bytes(config.staging_size), name=f"{name} staging (staging_size)", reserve_bytes=reserve
        )
    # One-off buffers (entries larger than the staging area) must leave this much free too.
    one_off_reserve = reserve if reserve is not None else default_reserve_bytes()
    return pool, staging_pool, StagingArea(staging_pool, HeapAllocator(f"{name}-heap"), one_off_reserve)
