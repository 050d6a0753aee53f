"""Memory objects: the formats entries are stored in, shape and payload helpers, the
reference-counted :class:`MemoryObj`, the allocator surface it returns its block to, and the
unpooled :class:`HeapAllocator`.

Part of :mod:`lmcache_async.memory` (the public face); the pool is :mod:`lmcache_async.memory.pool`.
"""

from __future__ import annotations

import abc
import ctypes
import enum
import threading
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.errors import DoubleReleaseError
from lmcache_async.memory.host import address_view, cuda_pinning_available

__all__ = [
    "AllocatorBase",
    "HeapAllocator",
    "MemoryFormat",
    "MemoryObj",
    "copy_payload",
    "payload_nbytes",
    "validate_shape",
]


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
        alloc: AllocatorBase,
        offset: int,
        size: int,
        tensor: torch.Tensor | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        nbytes: int | None = None,
    ) -> None:
        """``tensor`` None: the allocator makes the view on first use (:meth:`AllocatorBase._view`)."""
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
    def allocator(self) -> AllocatorBase:
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
        if not self.try_ref_count_down():
            raise DoubleReleaseError("MemoryObj released more times than it was acquired")

    def release(self) -> None:
        """Give back the reference a ``get``/``batched_get`` handed you (the same as
        :meth:`ref_count_down`; ``with obj:`` does it at the end of the block). Read or copy
        ``obj.tensor`` before: the pool may reuse the memory at once.

        Release exactly once. References are counted, not named: a second release while a tier
        still indexes the entry gives back the tier's reference instead (nothing is raised then;
        the tier finds its entry released at its next lookup and drops it as a counted miss,
        ``over_released``). :class:`DoubleReleaseError` is raised only once no reference is left."""
        self.ref_count_down()

    def get_ref_count(self) -> int:
        """Current number of references (0 once released)."""
        return self._refs

    def try_ref_count_down(self) -> bool:
        """Give one reference back unless none is left: False then, and nothing changes (for an
        owner that must not raise when someone else released its reference already)."""
        alloc = self._alloc
        with alloc.lock:
            if self._refs <= 0:
                return False
            self._refs -= 1
            if self._refs == 0:
                self._tensor = None
                alloc._free_locked(self.offset, self.size)
            return True

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


class AllocatorBase(abc.ABC):
    """Common surface of pooled and unpooled allocators; a subclass implements
    :meth:`allocate`, :meth:`byte_view` and :meth:`_free_locked`."""

    pooled: bool = False
    base_ptr: int = 0

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()

    @abc.abstractmethod
    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj | None:
        """A block holding ``shape`` of ``dtype`` (one reference, the caller's), or None when the
        allocator has no room."""

    @abc.abstractmethod
    def byte_view(self, offset: int, nbytes: int) -> memoryview:
        """Writable bytes ``offset .. offset + nbytes`` of the allocator's memory."""

    def address(self, offset: int) -> int:
        """Address of the block at ``offset``."""
        return self.base_ptr + offset

    @abc.abstractmethod
    def _free_locked(self, offset: int, size: int) -> None:
        """Return the block at ``offset`` of ``size`` bytes (the caller holds :attr:`lock`)."""

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The typed view of a block whose :class:`MemoryObj` was made without one (only
        :class:`PoolAllocator` makes such objects; the others pass their tensor)."""
        raise RuntimeError(f"{type(self).__name__} {self.name!r} gives every block its view at allocation")


class HeapAllocator(AllocatorBase):
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
