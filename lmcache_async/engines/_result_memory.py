"""Recycled host memory for the tensors an engine hands to its caller.

A ``get`` that returns a fresh CPU tensor pays for new memory: allocation plus one page fault
per 4 KiB page on first touch. Whether glibc hands a 256 KiB to 4 MiB block back already touched
depends on its heap layout (a freed region at the top of the heap is given back to the kernel
and faults again on the next use), so the same workload costs 35 µs or 150 µs per 256 KiB get
from one process to the next. :class:`ResultBuffers` keeps the blocks of results the caller has
dropped and hands them out again, so repeated reads of large entries touch warm memory.

Ownership: a result is the caller's alone. Its block is reused only once no reference to it
remains anywhere: the result tensor, every view of it and its storage all keep the block's
Python buffer alive, and a block is taken again only when the recycler holds the sole
reference (``sys.getrefcount``). Writes to the pool, evictions and later gets never touch the
memory of a result that is still referenced.
"""

from __future__ import annotations

import collections
import sys
import threading

import torch

from lmcache_async.memory import copy_payload

MIN_RECYCLED_BYTES = 64 << 10
"""Results smaller than this get plain ``torch.empty`` memory (glibc's bins recycle them well)."""

PARALLEL_COPY_BYTES = 1 << 20
"""Results of at least this size are copied with torch's ``copy_`` (its worker threads split the
copy: 1.6 x faster than one ``memmove`` at 1 MiB with a free core); smaller ones with one
``memmove``, which never waits for a worker thread (at 256 KiB the split saves a few µs with a
free core and costs milliseconds when the cores are busy)."""

_ALIGN = 64
_PROBES = 4
# A buffer no result uses is referred to by its _Block and by getrefcount's argument only.
_FREE_REFCOUNT = 2


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to its block size: four classes per power of two (≤ 25 % slack),
    at least 4 KiB steps."""
    step = max(4096, 1 << max(nbytes.bit_length() - 3, 0))
    return -(-nbytes // step) * step


class _Block:
    """One recycled buffer: the bytes, and the offset at which they are 64-byte aligned."""

    __slots__ = ("buf", "offset")

    def __init__(self, nbytes: int) -> None:
        self.buf = bytearray(nbytes + _ALIGN)  # zero-filled: every page is touched once here
        addr = torch.frombuffer(self.buf, dtype=torch.uint8).data_ptr()
        self.offset = -addr % _ALIGN


class ResultBuffers:
    """Contiguous CPU result tensors whose memory is recycled once the caller drops them.

    ``capacity_bytes`` bounds the bytes of all blocks this object holds (handed out or free);
    past it, results are plain ``torch.empty`` memory. Blocks are kept until :meth:`clear`.
    Safe to call from any thread (blocks move between rings atomically under the GIL; a block
    is handed out only after it was taken out of its ring).
    """

    def __init__(self, capacity_bytes: int, min_bytes: int = MIN_RECYCLED_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.min_bytes = min_bytes
        self._rings: dict[int, collections.deque[_Block]] = {}
        self._lock = threading.Lock()
        self._held = 0

    def _block(self, cls_bytes: int, ring: collections.deque[_Block]) -> _Block | None:
        """A block of ``cls_bytes`` no result references (taken out of ``ring``), or None."""
        for _ in range(min(_PROBES, len(ring))):
            try:
                block = ring.popleft()
            except IndexError:
                break
            if sys.getrefcount(block.buf) == _FREE_REFCOUNT:
                return block
            ring.append(block)  # still referenced by a result: look at the next one
        with self._lock:
            if self._held + cls_bytes > self.capacity_bytes:
                return None
            self._held += cls_bytes
        return _Block(cls_bytes)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` that nothing else
        references; from a recycled block when it is at least ``min_bytes`` and one is free."""
        nbytes = shape.numel() * dtype.itemsize
        if nbytes < self.min_bytes or nbytes > self.capacity_bytes:
            return torch.empty(shape, dtype=dtype)
        cls_bytes = size_class(nbytes)
        ring = self._rings.get(cls_bytes)
        if ring is None:
            with self._lock:
                ring = self._rings.setdefault(cls_bytes, collections.deque())
        block = self._block(cls_bytes, ring)
        if block is None:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(block.buf, dtype=torch.uint8, count=nbytes, offset=block.offset)
        out = raw.view(dtype).view(shape)
        del raw
        ring.append(block)  # handed out: its refcount now says so until the result is gone
        return out

    def copy_of(self, src: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy of the CPU tensor ``src`` (same shape and dtype), in memory the
        caller owns: nothing writes it while any reference to it or its storage is alive."""
        out = self.empty(src.shape, src.dtype)
        if out.numel() * out.element_size() < PARALLEL_COPY_BYTES:
            copy_payload(out, src)  # torch's copy_ for what a memmove cannot copy (conj, strides)
        else:
            out.copy_(src)
        return out

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks this object holds, handed out or free."""
        return self._held

    def clear(self) -> None:
        """Forget every block; results still referenced keep their memory (it is freed with
        them)."""
        with self._lock:
            self._rings = {}
            self._held = 0
