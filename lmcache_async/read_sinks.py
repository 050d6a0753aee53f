"""Caller-owned destinations for reads: one entry's payload straight into scattered host memory.

A :class:`ReadSink` names where the bytes of one stored entry go: a list of ``(address, nbytes)``
pieces of host memory the caller owns, filled in payload order. The KV connector points the
pieces at the blocks of vLLM's paged caches, so a read from the disk tier lands in those blocks
with no buffer in between (:meth:`StorageManager.read_into_sync
<lmcache_async.storage_manager.StorageManager.read_into_sync>`), and a CPU-tier hit is one
``memmove`` per piece.

A sink may also carry ``tensor``: a strided CPU view of the caller's memory whose elements, in
row-major order, are exactly the pieces (:meth:`ReadSink.over` builds one from such a view, the
SGLang host pool's ``layer_first`` pages, one run per K/V and layer). A CPU-tier hit then fills
it in one ``copy_`` (one kernel over every run) instead of one ``memmove`` per piece from Python;
readers that need addresses (the disk tier's ``preadv``) still use the pieces.

The copies here start no OpenMP team, so they may run on any thread beside a compute thread:
``memmove`` is single-threaded, and the ``copy_`` of ``tensor`` is taken only when the calling
thread's intra-op thread count (``torch.get_num_threads()``) is 1 — the condition under which
``at::parallel_for`` runs its loop inline on the caller (SGLang runs with ``OMP_NUM_THREADS=1``);
otherwise the pieces are copied one ``memmove`` each. Both release the GIL.

Contract for whoever fills a sink: the pieces receive exactly the entry's payload or, on any
failure, bytes that the caller must not use (a read that fails half-way leaves the pieces
partly written; the caller treats the whole sink as unfilled). Nothing is written outside the
pieces (``tensor``, when set, covers exactly the pieces: checked at construction).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache_async.memory import MemoryObj, address_view, payload_nbytes

__all__ = ["Piece", "ReadSink", "coalesce"]

Piece = tuple[int, int]
"""``(address, nbytes)``: a run of host memory."""

_memmove = ctypes.memmove
_num_threads = torch.get_num_threads


def coalesce(pieces: Sequence[Piece]) -> list[Piece]:
    """``pieces`` with every piece that starts where the previous one ends merged into it (the
    same bytes in the same order, fewer copies)."""
    out: list[Piece] = []
    for addr, n in pieces:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((addr, n))
    return out


@functools.lru_cache(maxsize=256)
def _run_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[Piece, ...]:
    """The contiguous runs of a strided view of ``shape``/``strides`` in row-major order, each
    run that starts where the previous one ends merged into it, as ``(offset, nbytes)`` with the
    offset in bytes from the view's first element. ``ValueError`` for a zero or negative stride
    on an axis longer than 1 or runs that overlap. Cached: a caller builds many sinks of one
    geometry (the pages of a pool), which differ only in their first element's address."""
    k, inner = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    offsets = [0]
    for d in range(k):
        if shape[d] == 1:
            continue
        if strides[d] <= 0:
            raise ValueError(f"tensor has stride {strides[d]} on axis {d}; a sink's runs must not repeat")
        step = strides[d] * itemsize
        offsets = [off + i * step for off in offsets for i in range(shape[d])]
    run = inner * itemsize
    ordered = sorted(offsets)
    if any(b - a < run for a, b in itertools.pairwise(ordered)):
        raise ValueError("tensor's runs overlap; a sink's pieces must be distinct bytes")
    return tuple(coalesce([(off, run) for off in offsets]))


def _tensor_pieces(t: torch.Tensor) -> tuple[Piece, ...]:
    """The runs of host memory that ``t``'s elements occupy, in row-major order, coalesced."""
    if t.numel() == 0:
        return ()
    base = t.data_ptr()
    if base <= 0:
        raise ValueError("tensor has no memory (data_ptr 0)")
    return tuple([(base + off, n) for off, n in _run_layout(t.shape, t.stride(), t.element_size())])


@dataclass(frozen=True, slots=True)
class ReadSink:
    """Where one entry of ``shape``/``dtype`` is read to: ``pieces`` in payload order.

    The caller owns the memory and keeps it valid until the read that fills the sink returned.
    Construction checks that the pieces add up to the payload (``ValueError`` naming
    ``pieces``) and that each has a positive length and a non-zero address.

    ``tensor`` (optional; :meth:`over` builds a sink from it): a CPU view of the same memory
    whose elements in row-major order are exactly the pieces, same dtype, any shape of the
    payload's element count. Construction checks that its runs are the pieces (``ValueError``
    naming ``tensor``); a CPU-tier hit is then copied into it in one ``copy_`` (see the module
    docstring for when). Not part of equality.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def over(cls, tensor: torch.Tensor, shape: Sequence[int] | None = None) -> ReadSink:
        """A sink whose pieces are the memory of ``tensor`` (a CPU view of the caller's memory,
        strided along its leading axes, contiguous within each run) and which carries it as
        :attr:`tensor`; the entry's shape is ``shape`` (default ``tensor``'s), with the same
        element count. ``ValueError`` for a tensor not on the CPU, one that requires grad, a
        negative or zero stride, overlapping runs, or an element count that differs. An
        inference tensor is not kept (torch refuses to write one in place outside inference
        mode): that sink has only the pieces, filled one ``memmove`` each."""
        _check_tensor(tensor)
        if shape is None:
            want = tuple(tensor.shape)
        else:
            want = tuple(int(d) for d in shape)
            if payload_nbytes(want, tensor.dtype) != tensor.numel() * tensor.element_size():
                raise ValueError(f"tensor has {tensor.numel()} elements; a {want} payload has another count")
        pieces = _tensor_pieces(tensor)
        if not pieces:
            return cls(want, tensor.dtype, pieces)
        # The pieces are the tensor's runs by construction (positive lengths, non-zero
        # addresses, the payload's size), so the checks of __init__ are not repeated.
        sink = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(sink, "shape", want)
        setattr_(sink, "dtype", tensor.dtype)
        setattr_(sink, "pieces", pieces)
        setattr_(sink, "tensor", None if tensor.is_inference() else tensor)
        return sink

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        total = 0
        for i, piece in enumerate(self.pieces):
            addr, n = piece
            if not isinstance(addr, int) or not isinstance(n, int) or addr <= 0 or n <= 0:
                raise ValueError(f"pieces[{i}] must be (address > 0, nbytes > 0), got {piece!r}")
            total += n
        want = payload_nbytes(self.shape, self.dtype)
        if total != want:
            raise ValueError(f"pieces hold {total} bytes; a {self.shape} {self.dtype} payload is {want}")
        t = self.tensor
        if t is not None:
            _check_tensor(t)
            if t.is_inference():
                raise ValueError("tensor is an inference tensor; it cannot be written in place outside inference mode")
            if t.dtype != self.dtype:
                raise ValueError(f"tensor is {t.dtype}; the sink is {self.dtype}")
            if t.numel() * t.element_size() != want or _tensor_pieces(t) != tuple(coalesce(self.pieces)):
                raise ValueError("tensor's memory is not exactly the pieces, in order")

    @property
    def nbytes(self) -> int:
        """Payload bytes the sink takes."""
        return sum(n for _, n in self.pieces)

    def fits(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """True when an entry of ``shape``/``dtype`` is what this sink expects."""
        return dtype == self.dtype and tuple(shape) == self.shape

    def views(self) -> list[memoryview]:
        """Writable byte views of the pieces, in order (valid while the caller's memory is)."""
        return [address_view(addr, n) for addr, n in self.pieces]

    def fill_from(self, obj: MemoryObj) -> bool:
        """Copy ``obj``'s payload into the pieces; False, nothing written, when ``obj`` is not a
        contiguous host entry of this sink's shape and dtype.

        With :attr:`tensor` and one intra-op thread on the calling thread: one ``copy_`` from
        ``obj``'s tensor into it (single-threaded, see the module docstring). Otherwise one
        ``memmove`` per piece (no tensor view of ``obj`` is made)."""
        src = obj.host_address
        if src is None or not self.fits(obj.shape, obj.dtype):
            return False
        dst = self.tensor
        if dst is not None and len(self.pieces) > 1 and _num_threads() == 1:
            data = obj.tensor
            dst.copy_(data if data.shape == dst.shape else data.view(dst.shape))
            return True
        for addr, n in self.pieces:
            _memmove(addr, src, n)
            src += n
        return True


def _check_tensor(t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"tensor is on {t.device}; a sink is host memory")
    if t.requires_grad:
        raise ValueError("tensor requires grad; a sink is written in place")
