"""Host memory: what the machine has (``/proc/meminfo``), whether pinning is possible, raw byte
views of addresses and tensors, and the pre-touch of pool pages (``madvise``) with its exit hook.

Part of :mod:`lmcache_async.memory` (the public face), which the allocators build on.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import weakref

import torch

from lmcache_async.at_exit import call_at_exit
from lmcache_async.errors import PoolSizeError

__all__ = [
    "PRETOUCH_EXIT_WAIT_S",
    "GiB",
    "MiB",
    "address_view",
    "check_pool_fits",
    "cuda_pinning_available",
    "gib_to_bytes",
    "memory_available_bytes",
    "memory_total_bytes",
    "populate_pages",
    "tensor_byte_view",
    "track_pretouch_thread",
]

GiB = 1 << 30
MiB = 1 << 20
_PAGE = 4096


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


def track_pretouch_thread(thread: threading.Thread) -> None:
    """Have the exit hook (:func:`_stop_pretouch`) stop ``thread``'s pre-touch loop and wait for
    its current step: a daemon thread still inside madvise when the interpreter finalizes aborts
    the process ("terminate called without an active exception")."""
    _PRETOUCH_THREADS.add(thread)


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
