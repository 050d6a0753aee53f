"""Pre-touched memory for stage payloads: where a record is encoded, and what a get returns.

A large tensor allocated afresh pays one page fault per 4 KiB page on its first write (4096 of
them for 16 MiB), which costs several times the copy into it. :class:`PayloadBuffers` keeps a
pool of memory touched once at start-up (``payload_buffer_size``) and hands out blocks of it
(:meth:`PayloadBuffers.allocate`, a :class:`~lmcache_async.tiers.Allocate`): a put encodes
its record into one, a read from a tier lands in one.

:meth:`PayloadBuffers.take` turns a block holding a tensor payload into the tensor handed to a
caller of ``get``, without a copy. It is an ordinary CPU tensor the caller owns; its memory
goes back to the pool when the last tensor (or numpy array) sharing its storage is freed, by
whichever thread frees it. It cannot be resized (``resize_`` raises); everything else behaves
as for ``torch.empty``.

A payload smaller than :data:`MIN_POOLED_BYTES`, one the pool has no room for right now (the
callers hold its memory) or any payload when the pool size is 0 gets a fresh heap buffer
instead: the pool bounds the memory, never the gets. Every method may be called from any thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator, copy_payload, payload_nbytes

__all__ = ["MIN_POOLED_BYTES", "PayloadBuffers"]

MIN_POOLED_BYTES = 256 * 1024
"""Payloads below this size are allocated afresh: their page faults cost less than the pool's
bookkeeping."""


class PayloadBuffers:
    """A pool of ``size_bytes`` of pre-touched memory named ``name`` (none when 0); see the
    module docstring. ``pooled`` and ``fresh`` count the blocks served from the pool and
    allocated afresh (figures may miss an increment under a race)."""

    def __init__(self, size_bytes: int, name: str) -> None:
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"size_bytes must be an int >= 0, got {size_bytes!r}")
        self._pool = PoolAllocator(size_bytes, name=name) if size_bytes else None
        self._heap = HeapAllocator(f"{name} (fresh)", pin=False)
        self.pooled = 0
        self.fresh = 0

    @property
    def capacity(self) -> int:
        """Bytes in the pool (0: no pool)."""
        return 0 if self._pool is None else self._pool.capacity

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj:
        """A block of ``shape``/``dtype`` with one reference the caller owns: from the pool when
        it is large enough to be worth it and there is room, else a fresh heap buffer. Never
        None."""
        pool = self._pool
        if pool is not None and payload_nbytes(shape, dtype) >= MIN_POOLED_BYTES:
            obj = pool.allocate(shape, dtype, fmt)
            if obj is not None:
                self.pooled += 1
                return obj
        self.fresh += 1
        return self._heap.allocate(shape, dtype, fmt)

    def take(self, obj: MemoryObj) -> torch.Tensor:
        """``obj``'s payload as a tensor the caller owns, consuming the caller's reference to
        ``obj``: a block of these buffers becomes the tensor without a copy (its memory returns
        to the pool when the tensor's storage is freed); any other block is copied into a new
        buffer and released."""
        if obj.allocator is self._heap:
            t = obj.tensor
            obj.ref_count_down()  # the tensor keeps its own storage alive
            return t
        if obj.allocator is not self._pool:
            try:
                return self.copy_of(obj.tensor)
            finally:
                obj.ref_count_down()
        try:
            # Outside inference mode even when the caller is in it: an inference tensor could
            # not be written in place later, outside inference mode.
            with torch.inference_mode(False):
                arr: Any = obj.raw.numpy()
                base = torch.from_numpy(arr)
        except BaseException:
            obj.ref_count_down()
            raise
        # The storage of ``base`` keeps ``arr`` alive: once the last tensor sharing that storage
        # is freed, ``arr`` goes and the block returns to the pool.
        weakref.finalize(arr, obj.ref_count_down)
        del arr
        with torch.inference_mode(False):
            return base.view(obj.dtype).view(obj.shape)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor the caller owns (see :meth:`take`)."""
        return self.take(self.allocate(shape, dtype))

    def copy_of(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of ``src`` (any device) in a tensor from :meth:`empty`."""
        out = self.empty(src.shape, src.dtype)
        copy_payload(out, src)
        return out

    def stats(self) -> dict[str, int]:
        """``capacity``, ``free`` bytes, and the ``pooled``/``fresh`` counts. Any thread."""
        pool = self._pool
        return {
            "capacity": self.capacity,
            "free": 0 if pool is None else pool.free_bytes,
            "pooled": self.pooled,
            "fresh": self.fresh,
        }
