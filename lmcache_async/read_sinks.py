"""Caller-owned destinations for reads: one entry's payload straight into scattered host memory.

A :class:`ReadSink` names where the bytes of one stored entry go: a list of ``(address, nbytes)``
pieces of host memory the caller owns, filled in payload order. The KV connector points the
pieces at the blocks of vLLM's paged caches, so a read from the disk tier lands in those blocks
with no buffer in between (:meth:`StorageManager.read_into_sync
<lmcache_async.storage_manager.StorageManager.read_into_sync>`), and a CPU-tier hit is one
``memmove`` per piece.

The copies here are single-threaded ``memmove`` calls that release the GIL and start no
OpenMP team, so they may run on any thread beside a compute thread.

Contract for whoever fills a sink: the pieces receive exactly the entry's payload or, on any
failure, bytes that the caller must not use (a read that fails half-way leaves the pieces
partly written; the caller treats the whole sink as unfilled). Nothing is written outside the
pieces.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_async.memory import MemoryObj, address_view, payload_nbytes

__all__ = ["Piece", "ReadSink", "coalesce"]

Piece = tuple[int, int]
"""``(address, nbytes)``: a run of host memory."""

_memmove = ctypes.memmove


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


@dataclass(frozen=True, slots=True)
class ReadSink:
    """Where one entry of ``shape``/``dtype`` is read to: ``pieces`` in payload order.

    The caller owns the memory and keeps it valid until the read that fills the sink returned.
    Construction checks that the pieces add up to the payload (``ValueError`` naming
    ``pieces``) and that each has a positive length and a non-zero address.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

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
        """Copy ``obj``'s payload into the pieces (one ``memmove`` each; no tensor view is made);
        False, nothing written, when ``obj`` is not a contiguous host entry of this sink's
        shape and dtype."""
        src = obj.host_address
        if src is None or not self.fits(obj.shape, obj.dtype):
            return False
        for addr, n in self.pieces:
            _memmove(addr, src, n)
            src += n
        return True
