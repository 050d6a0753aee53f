"""Buffers outside the cache budget: where lower-tier reads land, and what carries a put that
skips the CPU tier down to the lower tiers.

Two sources: the preallocated staging pool (``staging_size`` GiB; absent when 0), and one-off heap
buffers for an entry the pool cannot take. A one-off buffer is handed out only when it leaves
the memory reserve free (``memory_reserve_size``, the same reserve the pools are sized against),
so a burst of large entries slows down instead of exhausting the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async.memory import (
    GiB,
    HeapAllocator,
    MemoryFormat,
    MemoryObj,
    PoolAllocator,
    memory_available_bytes,
    payload_nbytes,
)

__all__ = ["StagingArea", "default_reserve_bytes"]


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
