"""Memory: formats, reference-counted memory objects and pool allocators.

A :class:`PoolAllocator` owns one contiguous buffer (pinned when CUDA is available, pageable
otherwise) and carves it into aligned blocks. A :class:`MemoryObj` is a typed view of one
block with an explicit reference count: the creator holds one reference; each holder that
wants the block to stay alive takes another with :meth:`MemoryObj.ref_count_up` and gives it
back with :meth:`MemoryObj.ref_count_down`. When the count reaches zero the block returns to
its pool. Releasing more often than acquired raises :class:`DoubleReleaseError`.

Allocation never waits: when no block is large enough it returns ``None`` at once (eviction is
the caller's business — tiers evict what nobody holds and try again).

This module is the public face; the work is split by job:

* :mod:`lmcache_async.memory.host`: the machine's memory, pinning, raw byte views, page pre-touch;
* :mod:`lmcache_async.memory.objects`: formats, :class:`MemoryObj`, the heap allocator;
* :mod:`lmcache_async.memory.pool`: :class:`PoolAllocator` and its view cache.
"""

from __future__ import annotations

# The pre-touch exit hook's state, named here as before (tests check it from a child process).
from lmcache_async.memory.host import _PRETOUCH_STOP as _PRETOUCH_STOP
from lmcache_async.memory.host import _PRETOUCH_THREADS as _PRETOUCH_THREADS
from lmcache_async.memory.host import (
    PRETOUCH_EXIT_WAIT_S,
    GiB,
    MiB,
    address_view,
    check_pool_fits,
    cuda_pinning_available,
    gib_to_bytes,
    memory_available_bytes,
    memory_total_bytes,
    populate_pages,
    tensor_byte_view,
)
from lmcache_async.memory.objects import (
    AllocatorBase,
    HeapAllocator,
    MemoryFormat,
    MemoryObj,
    copy_payload,
    payload_nbytes,
    validate_shape,
)
from lmcache_async.memory.pool import DEFAULT_ALIGN, PoolAllocator, view_cache_limit

__all__ = [
    "DEFAULT_ALIGN",
    "PRETOUCH_EXIT_WAIT_S",
    "AllocatorBase",
    "GiB",
    "HeapAllocator",
    "MemoryFormat",
    "MemoryObj",
    "MiB",
    "PoolAllocator",
    "address_view",
    "check_pool_fits",
    "copy_payload",
    "cuda_pinning_available",
    "gib_to_bytes",
    "memory_available_bytes",
    "memory_total_bytes",
    "payload_nbytes",
    "populate_pages",
    "tensor_byte_view",
    "validate_shape",
    "view_cache_limit",
]
