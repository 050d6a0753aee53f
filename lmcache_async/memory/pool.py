"""The pool allocator: one contiguous buffer (pinned when CUDA is available, pageable otherwise)
carved into aligned blocks, with segregated free lists, coalescing, a cache of tensor views and
a background pre-touch of its pages.

Part of :mod:`lmcache_async.memory` (the public face).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from lmcache_async.memory.host import (
    GiB,
    address_view,
    check_pool_fits,
    cuda_pinning_available,
    memory_available_bytes,
    populate_pages,
    track_pretouch_thread,
)
from lmcache_async.memory.objects import AllocatorBase, MemoryFormat, MemoryObj, validate_shape

# The logger of memory as a whole: its messages keep the name users filter on.
logger = logging.getLogger("lmcache_async.memory")

__all__ = ["DEFAULT_ALIGN", "PoolAllocator", "view_cache_limit"]

DEFAULT_ALIGN = 256
# A cached tensor view costs about 800 bytes (the tensor with its key and strides); one view
# per 32 KiB of pool keeps the cache below 2.5 % of the pool's bytes, beyond a floor of 64 views
# (about 50 KiB) that lets small pools cache their live blocks.
_VIEW_CACHE_BYTES_PER_VIEW = 32 << 10
_VIEW_CACHE_MIN = 64
_VIEW_CACHE_MAX = 1 << 16
_VIEW_CACHE_REFRESH = 8


def view_cache_limit(capacity: int) -> int:
    """Most tensor views a pool of ``capacity`` bytes keeps for reuse.

    One view per 32 KiB of pool (a view costs about 800 bytes, so the cache stays below 2.5 %
    of the pool), at least 64 and at most 65,536.
    """
    return max(_VIEW_CACHE_MIN, min(_VIEW_CACHE_MAX, capacity // _VIEW_CACHE_BYTES_PER_VIEW))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 1:
        return (1,)
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


class PoolAllocator(AllocatorBase):
    """A pool over one contiguous buffer with segregated free lists and coalescing.

    ``allocate`` returns a :class:`MemoryObj` or ``None`` at once when no free block fits.
    Freed blocks merge with free neighbours, so mixed-size churn does not fragment the pool.
    Thread-safe. The buffer is pre-touched in a background thread (``MADV_POPULATE_WRITE``,
    which never alters contents) so construction returns quickly and use is warm.
    """

    pooled = True

    def __init__(
        self,
        size_bytes: int,
        *,
        name: str = "pool",
        align: int = DEFAULT_ALIGN,
        pin: bool | None = None,
        pretouch: bool = True,
        reserve_bytes: int | None = None,
        buffer: torch.Tensor | None = None,
        committed_bytes: int | None = None,
    ) -> None:
        """``buffer``: a uint8 CPU tensor of at least ``size_bytes`` bytes the caller provides
        (and whose memory it has checked): no fit check, no pinning, no pre-touch here.
        ``committed_bytes``: only the first that many bytes are allocatable (default: all);
        :meth:`commit_more` hands out more as the caller makes them usable."""
        super().__init__(name)
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise ValueError(f"size_bytes must be a non-negative int, got {size_bytes!r}")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        size_bytes -= size_bytes % align
        self.capacity = size_bytes
        if buffer is None:
            if reserve_bytes is None:
                reserve_bytes = min(2 * GiB, max(GiB // 2, (memory_available_bytes() or 0) // 20))
            check_pool_fits(name, size_bytes, reserve_bytes)
            self.pinned = cuda_pinning_available() if pin is None else pin
            self.buffer = torch.empty(max(size_bytes, align), dtype=torch.uint8, pin_memory=self.pinned)
        else:
            if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or buffer.numel() < size_bytes:
                raise ValueError(f"buffer must be a uint8 CPU tensor of at least {size_bytes} bytes")
            self.pinned = False
            self.buffer = buffer
            pretouch = False
        self.base_ptr = self.buffer.data_ptr()
        #: Bytes at the start of the buffer the allocator may hand out (see :meth:`commit_more`).
        committed = size_bytes if committed_bytes is None else committed_bytes - committed_bytes % align
        self.committed = min(size_bytes, max(committed, 0))
        self._mv: memoryview | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._view_cache: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.view_cache_limit = view_cache_limit(size_bytes)
        self._view_evictions = 0
        units = size_bytes // align
        # Free blocks in units of `align`: start -> length and end -> start for coalescing;
        # bins[k] holds starts of blocks whose length has bit_length k.
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._bins: list[set[int]] = [set() for _ in range(max(units.bit_length(), 1) + 1)]
        self._mask = 0
        self.used_bytes = 0
        self.num_objects = 0
        if self.committed:
            self._insert_free(0, self.committed // align)
        self._touched = threading.Event()
        self._pretouch_stop = threading.Event()
        self._pretouch_thread: threading.Thread | None = None
        if pretouch and size_bytes and not self.pinned:
            # The exit hook stops the loop between steps and waits for the step (a daemon thread
            # still inside madvise when the interpreter finalizes aborts the process).
            thread = threading.Thread(target=self._pretouch, name=f"lmcache-async-pretouch-{name}", daemon=True)
            track_pretouch_thread(thread)
            self._pretouch_thread = thread
            thread.start()
        else:
            self._touched.set()

    # ---- pre-touch ---------------------------------------------------------------------------
    def _pretouch(self) -> None:
        try:
            populate_pages(self.base_ptr, self.capacity, stop=self._pretouch_stop)
        except Exception:  # pragma: no cover - best effort
            logger.debug("pre-touch of %s failed", self.name, exc_info=True)
        finally:
            self._touched.set()

    def commit_more(self, nbytes: int) -> int:
        """Make ``nbytes`` more (rounded down to the alignment, at most up to the capacity) of
        the buffer allocatable, after the bytes committed so far; the caller has made that
        memory usable. Returns the bytes committed now. Thread-safe."""
        with self.lock:
            new = min(self.capacity, self.committed + max(nbytes, 0) // self.align * self.align)
            if new > self.committed:
                start, length = self.committed // self.align, (new - self.committed) // self.align
                prev = self._free_end.get(start)
                if prev is not None:  # merge with the free block that ends where the new bytes start
                    plen = self._free_start[prev]
                    self._remove_free(prev, plen)
                    start, length = prev, length + plen
                self._insert_free(start, length)
                self.committed = new
            return self.committed

    def stop_pretouch(self, timeout: float = 1.0) -> None:
        """Stop the background pre-touch after its current step and wait for it (at most
        ``timeout`` seconds): the pool's owner calls it when it lets go of the pool, so the thread
        neither touches pages nobody will use nor keeps the pool alive. Untouched pages fault on
        first use, as without pre-touch. Any thread but the pre-touch thread; idempotent."""
        self._pretouch_stop.set()
        thread = self._pretouch_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the background pre-touch finished (True) or ``timeout`` passed (False)."""
        return self._touched.wait(timeout)

    # ---- free-list primitives (call with the lock held) ------------------------------------
    def _insert_free(self, start: int, length: int) -> None:
        self._free_start[start] = length
        self._free_end[start + length] = start
        k = length.bit_length()
        self._bins[k].add(start)
        self._mask |= 1 << k

    def _remove_free(self, start: int, length: int) -> None:
        del self._free_start[start]
        del self._free_end[start + length]
        k = length.bit_length()
        b = self._bins[k]
        b.discard(start)
        if not b:
            self._mask &= ~(1 << k)

    def _take(self, units: int) -> int | None:
        k = units.bit_length()
        bins = self._bins
        fs = self._free_start
        start = None
        if self._mask >> k & 1:
            # Same size class: blocks may be shorter than requested; look at a few.
            for i, s in enumerate(bins[k]):
                if fs[s] >= units:
                    start = s
                    break
                if i >= 8:
                    break
        if start is None:
            higher = self._mask >> (k + 1)
            if not higher:
                return None
            j = k + 1 + ((higher & -higher).bit_length() - 1)
            start = next(iter(bins[j]))
        length = fs[start]
        self._remove_free(start, length)
        if length > units:
            self._insert_free(start + units, length - units)
        return start

    def _free_locked(self, offset: int, size: int) -> None:
        start = offset // self.align
        length = size // self.align
        self.used_bytes -= size
        self.num_objects -= 1
        prev = self._free_end.get(start)
        if prev is not None:
            plen = self._free_start[prev]
            self._remove_free(prev, plen)
            start, length = prev, length + plen
        nxt_len = self._free_start.get(start + length)
        if nxt_len is not None:
            self._remove_free(start + length, nxt_len)
            length += nxt_len
        self._insert_free(start, length)

    # ---- public ----------------------------------------------------------------------------
    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj | None:
        """A block holding ``shape``/``dtype``, or ``None`` at once when none fits. No torch
        call: the block's tensor view is made on the object's first :attr:`MemoryObj.tensor`."""
        shp = validate_shape(shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        numel = 1
        for d in shp:
            numel *= d
        n = numel * dtype.itemsize
        align = self.align
        units = -(-n // align) or 1
        if units * align > self.committed - self.used_bytes:
            # Fewer free bytes than the block needs, read without the lock (an int read is
            # atomic): no block fits at this moment. Callers that evict and retry (the CPU tier
            # under churn) fail here at once instead of searching the free lists.
            return None
        with self.lock:
            start = self._take(units)
            if start is None:
                return None
            size = units * align
            self.used_bytes += size
            self.num_objects += 1
        return MemoryObj(self, start * align, size, None, shp, dtype, fmt, n)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The block's typed view (any thread). Blocks are reused at the same offsets for the
        same shapes under steady churn, and making a view costs more than the rest of an
        allocation, so views are cached and reused (a hit takes no lock; only a miss, which
        makes a view anyway, takes the lock to insert)."""
        typed = self._typed.get(dtype)
        if typed is None:
            with torch.inference_mode(False):  # see the view below
                typed = self._typed[dtype] = self.buffer.view(dtype)
        vkey = (offset, shape, dtype)
        cached = self._view_cache.get(vkey)
        # (a holder may have changed a view's metadata in place, e.g. with ``t_()``)
        if cached is not None and cached[0].stride() == cached[1] and cached[0].shape == shape:
            return cached[0]
        strides = (1,) if len(shape) == 1 else _contiguous_strides(shape)
        # Outside inference mode even when the caller is in it (a vLLM worker): the view is
        # cached and reused by later callers, and an inference-mode view of the pool could
        # not be written in place by a caller outside inference mode.
        with torch.inference_mode(False):
            view = typed.as_strided(shape, strides, offset // dtype.itemsize)
        with self.lock:
            self._cache_view_locked(vkey, view, strides)
        return view

    def _cache_view_locked(
        self, vkey: tuple[int, tuple[int, ...], torch.dtype], view: torch.Tensor, strides: tuple[int, ...]
    ) -> None:
        """Insert a view, keeping the cache at most ``view_cache_limit`` entries.

        A full cache drops its newest entry, so the views cached first keep hitting when more
        distinct blocks are in use than the cache holds; after ``_VIEW_CACHE_REFRESH`` times
        ``view_cache_limit`` such drops it is emptied, so a workload whose shapes or offsets
        changed refills it.
        """
        cache = self._view_cache
        if len(cache) >= self.view_cache_limit:
            self._view_evictions += 1
            if self._view_evictions >= _VIEW_CACHE_REFRESH * self.view_cache_limit:
                cache.clear()
                self._view_evictions = 0
            else:
                cache.popitem()
        cache[vkey] = (view, strides)

    @property
    def view_cache_entries(self) -> int:
        """Tensor views cached for reuse (never more than ``view_cache_limit``)."""
        return len(self._view_cache)

    def byte_view(self, offset: int, nbytes: int) -> memoryview:
        mv = self._mv
        if mv is None:
            mv = self._mv = address_view(self.base_ptr, self.capacity)
        return mv[offset : offset + nbytes]

    def can_ever_fit(self, nbytes: int) -> bool:
        """True when a block of ``nbytes`` fits into the empty pool."""
        return max(1, -(-nbytes // self.align)) * self.align <= self.capacity

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated (possibly fragmented)."""
        return self.capacity - self.used_bytes

    def largest_free_block(self) -> int:
        """Size in bytes of the largest free block."""
        with self.lock:
            return max(self._free_start.values(), default=0) * self.align

    def stats(self) -> dict[str, int | float | bool]:
        """Capacity, bytes and objects in use, and the largest free block."""
        return {
            "capacity_bytes": self.capacity,
            "used_bytes": self.used_bytes,
            "objects": self.num_objects,
            "largest_free_bytes": self.largest_free_block(),
            "pinned": self.pinned,
        }
