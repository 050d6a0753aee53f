"""Memory: formats, reference-counted memory objects and pool allocators.

A :class:`PoolAllocator` owns one contiguous buffer (pinned when CUDA is available, pageable
otherwise) and carves it into aligned blocks. A :class:`MemoryObj` is a typed view of one
block with an explicit reference count: the creator holds one reference; each holder that
wants the block to stay alive takes another with :meth:`MemoryObj.ref_count_up` and gives it
back with :meth:`MemoryObj.ref_count_down`. When the count reaches zero the block returns to
its pool. Releasing more often than acquired raises :class:`DoubleReleaseError`.

Allocation never waits: when no block is large enough it returns ``None`` at once (eviction is
the caller's business — tiers evict what nobody holds and try again).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.at_exit import call_at_exit
from lmcache_async.errors import DoubleReleaseError, PoolSizeError

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_ALIGN = 256
_PAGE = 4096
# A cached tensor view costs about 800 bytes (the tensor with its key and strides); one view
# per 32 KiB of pool keeps the cache below 2.5 % of the pool's bytes, beyond a floor of 64 views
# (about 50 KiB) that lets small pools cache their live blocks.
_VIEW_CACHE_BYTES_PER_VIEW = 32 << 10
_VIEW_CACHE_MIN = 64
_VIEW_CACHE_MAX = 1 << 16
_VIEW_CACHE_REFRESH = 8


class MemoryFormat(enum.IntEnum):
    """How the dimensions of an entry's tensor are to be read. Values are stored in records."""

    UNDEFINED = 0
    KV_2LTD = 1
    """KV chunk ``[2, num_layers, num_tokens, hidden]``."""
    KV_T2D = 2
    """KV chunk ``[num_tokens, 2, hidden]``."""
    EC_TD = 3
    """Encoder output, any shape (usually ``[num_tokens, hidden]``)."""
    HS_TD = 4
    """Hidden states ``[num_tokens, hidden]``."""
    BINARY = 5
    """Opaque bytes (uint8)."""


def cuda_pinning_available() -> bool:
    """True when pinned host memory can be allocated (a CUDA runtime and device are present)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA installs
        return False


def _meminfo_bytes(field: str) -> int | None:
    """``field`` (e.g. ``MemTotal``) from ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where it cannot be read)."""
    return _meminfo_bytes("MemAvailable")


def memory_total_bytes() -> int | None:
    """``MemTotal`` from ``/proc/meminfo`` (None where it cannot be read)."""
    return _meminfo_bytes("MemTotal")


def check_pool_fits(name: str, size_bytes: int, reserve_bytes: int) -> None:
    """Raise :class:`PoolSizeError` when ``size_bytes`` exceeds available memory minus a reserve."""
    avail = memory_available_bytes()
    if avail is None:
        return
    if size_bytes > avail - reserve_bytes:
        raise PoolSizeError(
            f"{name} pool of {size_bytes / GiB:.2f} GiB does not fit: {avail / GiB:.2f} GiB of memory "
            f"is available and {reserve_bytes / GiB:.2f} GiB is kept in reserve; lower the pool size"
        )


def payload_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (no checks)."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def copy_payload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype): one single-threaded ``memmove`` when
    both are contiguous CPU tensors, else ``dst.copy_(src)``. torch's parallel ``copy_`` waits
    on its worker threads, which costs milliseconds per large copy when the cores are busy."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and dst.is_contiguous()
        and src.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
    ):
        n = src.numel() * src.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)


def validate_shape(shape: Any, what: str = "shape") -> tuple[int, ...]:
    """Normalise a shape to a tuple of non-negative ints (``TypeError``/``ValueError`` otherwise)."""
    if type(shape) is tuple:
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    if isinstance(shape, torch.Size):
        return tuple(shape)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{what} must be a tuple of ints, got {type(shape).__name__}")
    out = []
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"{what} must contain ints, got {d!r}")
        if d < 0:
            raise ValueError(f"{what} must not contain negative sizes, got {tuple(shape)}")
        out.append(d)
    return tuple(out)


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


class MemoryObj:
    """A typed, reference-counted view of one block of memory.

    ``tensor`` is a view of the block with the object's ``shape`` and ``dtype``; it stays valid
    while the holder keeps its reference. A pool block's view is made on first use (an
    allocation then costs no torch call: callers that only copy bytes use :attr:`data_ptr` or
    :meth:`byte_view`). Ref-count changes are thread-safe. Use as a context manager to release
    the caller's reference on exit.
    """

    __slots__ = (
        "__weakref__",
        "_alloc",
        "_refs",
        "_tensor",
        "dtype",
        "fmt",
        "nbytes",
        "offset",
        "shape",
        "size",
    )

    def __init__(
        self,
        alloc: _AllocatorBase,
        offset: int,
        size: int,
        tensor: torch.Tensor | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        nbytes: int | None = None,
    ) -> None:
        """``tensor`` None: the allocator makes the view on first use (:meth:`_AllocatorBase._view`)."""
        self._alloc = alloc
        self.offset = offset
        self.size = size  # bytes reserved (aligned)
        self.nbytes = payload_nbytes(shape, dtype) if nbytes is None else nbytes  # payload bytes
        self._tensor: torch.Tensor | None = tensor
        self.shape = shape
        self.dtype = dtype
        self.fmt = fmt
        self._refs = 1

    # ---- data access -------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The typed view; raises ``RuntimeError`` once the last reference was released."""
        t = self._tensor
        if t is None:
            if self._refs <= 0:
                raise RuntimeError("MemoryObj was released; its tensor is no longer valid")
            t = self._tensor = self._alloc._view(self.offset, self.shape, self.dtype)
            if self._refs <= 0:  # released meanwhile by a holder (the caller held no reference)
                self._tensor = None
                raise RuntimeError("MemoryObj was released; its tensor is no longer valid")
        return t

    @property
    def raw(self) -> torch.Tensor:
        """The payload as a flat uint8 tensor (``nbytes`` long)."""
        t = self.tensor
        if t.dtype == torch.uint8 and t.dim() == 1:
            return t
        return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)

    def byte_view(self) -> memoryview:
        """A writable memoryview of the payload bytes (zero copy, for file/socket I/O)."""
        return self._alloc.byte_view(self.offset, self.nbytes)

    @property
    def allocator(self) -> _AllocatorBase:
        """The allocator the block came from."""
        return self._alloc

    @property
    def is_pooled(self) -> bool:
        """True when the block lives in a preallocated pool (registered/pinned memory)."""
        return self._alloc.pooled

    @property
    def data_ptr(self) -> int:
        """Address of the payload's first byte."""
        return self._alloc.address(self.offset)

    @property
    def host_address(self) -> int | None:
        """Address of the payload when it is one contiguous run of host memory (a pool block
        always is; no view is made for it), None otherwise (a device tensor, a strided view)."""
        t = self._tensor
        if t is None:  # a pool block with no view yet: contiguous host memory by construction
            return self._alloc.address(self.offset)
        return t.data_ptr() if t.device.type == "cpu" and t.is_contiguous() else None

    # ---- reference counting --------------------------------------------------------------
    def ref_count_up(self) -> None:
        """Take one more reference. Raises ``RuntimeError`` on a released object."""
        with self._alloc.lock:
            if self._refs <= 0:
                raise DoubleReleaseError("ref_count_up on a released MemoryObj")
            self._refs += 1

    def ref_count_down(self) -> None:
        """Give one reference back; the block returns to its pool when none are left.

        Raises :class:`DoubleReleaseError` when no reference is left to give back.
        """
        alloc = self._alloc
        with alloc.lock:
            refs = self._refs - 1
            if refs < 0:
                raise DoubleReleaseError("MemoryObj released more times than it was acquired")
            self._refs = refs
            if refs == 0:
                self._tensor = None
                alloc._free_locked(self.offset, self.size)

    def release(self) -> None:
        """Give back the reference a ``get``/``batched_get`` handed you (the same as
        :meth:`ref_count_down`; ``with obj:`` does it at the end of the block). Read or copy
        ``obj.tensor`` before: the pool may reuse the memory at once. Raises
        :class:`DoubleReleaseError` when released more often than acquired."""
        self.ref_count_down()

    def get_ref_count(self) -> int:
        """Current number of references (0 once released)."""
        return self._refs

    def try_ref_count_up(self) -> bool:
        """Take a reference unless the object was already released (returns False then)."""
        with self._alloc.lock:
            if self._refs <= 0:
                return False
            self._refs += 1
            return True

    def __enter__(self) -> MemoryObj:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ref_count_down()

    def __repr__(self) -> str:
        return (
            f"MemoryObj(shape={self.shape}, dtype={self.dtype}, fmt={self.fmt.name}, "
            f"nbytes={self.nbytes}, refs={self._refs}, pooled={self.is_pooled})"
        )


class _AllocatorBase:
    """Common surface of pooled and unpooled allocators."""

    pooled: bool = False
    base_ptr: int = 0

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def byte_view(self, offset: int, nbytes: int) -> memoryview:  # pragma: no cover - abstract
        raise NotImplementedError

    def address(self, offset: int) -> int:
        """Address of the block at ``offset``."""
        return self.base_ptr + offset

    def _free_locked(self, offset: int, size: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The typed view of a block whose :class:`MemoryObj` was made without one (only
        :class:`PoolAllocator` makes such objects; the others pass their tensor)."""
        raise RuntimeError(f"{type(self).__name__} {self.name!r} gives every block its view at allocation")


class HeapAllocator(_AllocatorBase):
    """One-off, unpooled buffers (for reads larger than the staging area). Never returns None."""

    pooled = False

    def __init__(self, name: str = "heap", pin: bool | None = None) -> None:
        super().__init__(name)
        self._pin = cuda_pinning_available() if pin is None else pin
        self._views: dict[int, torch.Tensor] = {}
        self._next = 0
        self.used_bytes = 0

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj:
        """A fresh buffer of ``shape``/``dtype`` (pinned when CUDA is available)."""
        shp = validate_shape(shape)
        n = payload_nbytes(shp, dtype)
        # Buffers and views are made outside inference mode even when the caller is in it (a
        # vLLM worker): an inference tensor cannot be written in place outside inference mode,
        # and a block outlives the call that allocated it.
        with torch.inference_mode(False):
            buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=self._pin)
            view = buf[:n].view(dtype).view(shp) if n else torch.empty(shp, dtype=dtype)
        with self.lock:
            self._next += 1
            ident = self._next
            self._views[ident] = buf
            self.used_bytes += n
        return MemoryObj(self, ident, n, view, shp, dtype, fmt)

    def byte_view(self, offset: int, nbytes: int) -> memoryview:
        return address_view(self._views[offset].data_ptr(), nbytes)

    def address(self, offset: int) -> int:
        return self._views[offset].data_ptr()

    def _free_locked(self, offset: int, size: int) -> None:
        self._views.pop(offset, None)
        self.used_bytes -= size


class PoolAllocator(_AllocatorBase):
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
            # A daemon thread still inside madvise when the interpreter finalizes aborts the
            # process ("terminate called without an active exception"): the exit hook
            # (:func:`_stop_pretouch`) stops the loop between steps and waits for the step.
            thread = threading.Thread(target=self._pretouch, name=f"lmcache-async-pretouch-{name}", daemon=True)
            _PRETOUCH_THREADS.add(thread)
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


_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23


#: Set at interpreter exit: pre-touch loops stop after their current step.
_PRETOUCH_STOP = threading.Event()
_PRETOUCH_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: How long exit waits for the pre-touch threads to finish their current step, in all.
PRETOUCH_EXIT_WAIT_S = 5.0


def _stop_pretouch() -> None:  # pragma: no cover - runs at interpreter exit
    """Exit hook: stop every pre-touch loop and wait (bounded) until none is inside madvise,
    so no daemon thread returns from native code while the interpreter finalizes."""
    _PRETOUCH_STOP.set()
    deadline = time.monotonic() + PRETOUCH_EXIT_WAIT_S
    for thread in list(_PRETOUCH_THREADS):
        thread.join(max(0.0, deadline - time.monotonic()))


call_at_exit(_stop_pretouch)


def populate_pages(ptr: int, nbytes: int, step: int = 64 * MiB, stop: threading.Event | None = None) -> None:
    """Fault in the pages of ``[ptr, ptr + nbytes)`` without changing their contents.

    Uses ``madvise(MADV_HUGEPAGE)`` then ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14), in
    steps so other threads are not starved. A kernel without it leaves pages to fault on first use.
    ``stop``, when set, ends the loop before the next step (as interpreter exit does).
    """
    if not hasattr(os, "sysconf") or nbytes <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - non-glibc
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    if end <= start:
        return
    madvise(start, end - start, _MADV_HUGEPAGE)
    for off in range(start, end, step):
        if _PRETOUCH_STOP.is_set() or (stop is not None and stop.is_set()):  # exiting, or the owner let go
            return
        ln = min(step, end - off)
        if madvise(off, ln, _MADV_POPULATE_WRITE) != 0:
            return


def address_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview over ``nbytes`` at address ``ptr`` (no copy, no numpy).

    The caller keeps the owning tensor alive for as long as the view is used.
    """
    if nbytes <= 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def tensor_byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (zero copy); ``ValueError`` otherwise."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor must be a contiguous CPU tensor")
    return address_view(t.data_ptr(), t.numel() * t.element_size())


def gib_to_bytes(gib: float) -> int:
    """GiB (float) to bytes, rounded down."""
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"size must be a finite number of GiB >= 0, got {gib!r}")
    return int(gib * GiB)
