"""Shared-memory pools of the node cache server: one memfd per namespace.

The server creates the memfd, maps it and sub-allocates it with the ordinary pool allocator;
clients receive the descriptor over the Unix socket and map the same bytes
(:class:`PoolMapping`). The first :data:`HEADER_BYTES` of the file hold a magic and the pool's
generation number, so a client can tell a pool of a restarted server from the one it mapped
before; entry offsets count from the end of that header.

After the entry region the file holds the **version table**: one u64 per :data:`REGION_BYTES`
of the entry region, which the server increments whenever a committed entry whose block overlaps
that region leaves the index (removed or evicted), before its block can be freed and handed to
anyone else. A reader that copies an entry without a lease compares the sum of its regions'
counters, as the server saw it while the entry was indexed, with the sum after the copy: equal
sums mean the entry is still indexed at that block, so its bytes are the committed ones (the
counters only grow). The same check lets a client reuse a location it was told earlier. x86-64
orders the server's increment before any later writer's bytes for every other CPU (total store
order); on other architectures clients read under a lease instead (:data:`OPTIMISTIC_READS`).

The file is created **sparse** at its full size and the server commits its entry region in
steps as it fills (:class:`SharedPool`), so a pool costs memory for what it holds, not for its
capacity; clients map the whole file and fault in only the pages they touch.

The file is **sealed** (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before it is handed out:
no client can truncate it under the server (which would make the server's next access a
``SIGBUS``) or grow it; clients map the size the handshake announces and refuse an unsealed file.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import platform
import secrets
import struct

import torch

from lmcache_async.memory import DEFAULT_ALIGN, MiB, PoolAllocator, populate_pages

__all__ = [
    "GROW_STEP_MAX",
    "GROW_STEP_MIN",
    "HEADER_BYTES",
    "OPTIMISTIC_READS",
    "REGION_BYTES",
    "PoolMapping",
    "SharedPool",
    "new_generation",
    "pool_file_bytes",
    "version_sum",
]

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096
#: Bytes of the entry region covered by one counter of the version table.
REGION_SHIFT = 20
REGION_BYTES = 1 << REGION_SHIFT
_PAGE = 4096
#: Smallest and largest step by which a pool's committed memory grows.
GROW_STEP_MIN = 64 * MiB
GROW_STEP_MAX = 1024 * MiB
_HEADER = struct.Struct("<8sQQQI")  # magic, generation, data bytes, version table offset, region shift
_POOL_MAGIC = b"LMCSPOOL"
#: Whether this machine's memory order lets a client trust a lease-free copy checked by the
#: version table (see the module docstring); elsewhere every read takes a lease.
OPTIMISTIC_READS = platform.machine().lower() in ("x86_64", "amd64")
#: The seals every pool file carries before it leaves the server.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _regions(capacity: int) -> int:
    """Counters in the version table of a pool with ``capacity`` entry bytes."""
    return max(1, -(-capacity // REGION_BYTES))


def _table_layout(capacity: int, align: int) -> tuple[int, int]:
    """(table offset, file bytes) of a pool with ``capacity`` entry bytes."""
    table = HEADER_BYTES + -(-max(capacity, align, 1) // _PAGE) * _PAGE
    return table, table + -(-8 * _regions(capacity) // _PAGE) * _PAGE


def pool_file_bytes(capacity: int, align: int) -> int:
    """The size of the pool file of ``capacity`` entry bytes and alignment ``align``: what a
    client maps (never what ``fstat`` says)."""
    return _table_layout(capacity, align)[1]


def _region_range(offset: int, nbytes: int) -> tuple[int, int]:
    """First and one-past-last counter covering ``nbytes`` entry bytes at ``offset``."""
    return offset >> REGION_SHIFT, ((offset + max(nbytes, 1) - 1) >> REGION_SHIFT) + 1


def version_sum(versions: memoryview, offset: int, nbytes: int) -> int:
    """The sum of the counters of ``versions`` (a version table) under ``nbytes`` entry bytes
    at ``offset``: what a reader compares before and after a lease-free copy."""
    first, end = _region_range(offset, nbytes)
    return versions[first] if end == first + 1 else sum(versions[first:end])


def new_generation() -> int:
    """A fresh, random, non-zero 64-bit generation number."""
    return secrets.randbits(63) | 1


class SharedPool(PoolAllocator):
    """A :class:`PoolAllocator` whose buffer is a memfd the server can hand to clients.

    The file has the pool's full size from the start but is **sparse**: no entry byte takes
    memory until it is committed. Only the first :attr:`committed` entry bytes are allocatable;
    the server grows that prefix in steps (:meth:`next_step`, then :meth:`prepare` on a worker
    thread, then :meth:`commit_more` on the loop; see :mod:`lmcache_async.server.growth`), so
    creating a pool costs no memory and no time in the way of the first answers.

    ``fd`` stays open for the pool's life (it is sent to each admitted client); :meth:`close`
    closes it and unmaps when the last view is gone. Thread-safety is the allocator's.
    ``pretouch``: :meth:`prepare` also faults a committed step into the server's mapping.
    ``committed_bytes``: bytes committed at once, blocking (None: the whole pool, for tests and
    tools; the server passes 0 and grows the pool in the background).
    """

    def __init__(
        self,
        size_bytes: int,
        *,
        name: str,
        generation: int,
        reserve_bytes: int | None = None,
        pretouch: bool = True,
        committed_bytes: int | None = None,
    ) -> None:
        capacity = size_bytes - size_bytes % DEFAULT_ALIGN
        self.generation = generation
        self.pretouch = pretouch
        #: Memory kept free beside the pools when a step is checked (None: the allocator's rule).
        self.reserve_bytes = reserve_bytes
        #: True after a step was refused for lack of memory (the pool then evicts within what it
        #: has; the server tries again later).
        self.grow_refused = False
        self.fd = os.memfd_create(f"lmcache-async-{name}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        table_off, self.file_bytes = _table_layout(capacity, DEFAULT_ALIGN)
        try:
            os.ftruncate(self.fd, self.file_bytes)  # sparse: no page is allocated yet
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)  # no client can shrink or grow it
            self._mm = mmap.mmap(self.fd, self.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        _HEADER.pack_into(self._mm, 0, _POOL_MAGIC, generation, capacity, table_off, REGION_SHIFT)
        buffer = torch.frombuffer(self._mm, dtype=torch.uint8, offset=HEADER_BYTES, count=table_off - HEADER_BYTES)
        super().__init__(capacity, name=name, pin=False, pretouch=False, buffer=buffer, committed_bytes=0)
        #: The version table (native u64 counters; see the module docstring).
        self.versions = memoryview(self._mm)[table_off : table_off + 8 * _regions(self.capacity)].cast("Q")
        first = capacity if committed_bytes is None else min(max(committed_bytes, 0), capacity)
        if first:
            self.prepare(os.dup(self.fd), 0, first)
            self.commit_more(first)

    @property
    def can_grow(self) -> bool:
        """Whether more of the pool may still be committed (not all of it is, and the last
        step was not refused for lack of memory)."""
        return self.committed < self.capacity and not self.grow_refused

    def next_step(self) -> int:
        """Bytes the next growth step commits: as much as is committed already (so a pool
        doubles while it is small), at least :data:`GROW_STEP_MIN` and at most
        :data:`GROW_STEP_MAX` bytes, never past the capacity (0: nothing left)."""
        return min(self.capacity - self.committed, max(GROW_STEP_MIN, min(self.committed, GROW_STEP_MAX)))

    def prepare(self, fd: int, offset: int, nbytes: int) -> None:
        """Allocate the file's pages of ``nbytes`` entry bytes at ``offset`` (and fault them into
        the server's mapping when :attr:`pretouch`); blocking, for a worker thread. ``fd`` is a
        duplicate of :attr:`fd` the caller made for this call and that this call closes (the pool
        may be closed meanwhile). ``OSError`` when the memory cannot be had."""
        try:
            os.posix_fallocate(fd, HEADER_BYTES + offset, nbytes)
        finally:
            os.close(fd)
        if self.pretouch:
            populate_pages(self.base_ptr + offset, nbytes)

    def retire(self, offset: int, nbytes: int) -> None:
        """Move the version counters under ``nbytes`` entry bytes at ``offset``: called (on the
        loop thread) when the entry there leaves the index, before its block is given back."""
        versions = self.versions
        first, end = _region_range(offset, nbytes)
        for r in range(first, end):
            versions[r] += 1

    def version(self, offset: int, nbytes: int) -> int:
        """:func:`version_sum` of this pool's table (loop thread)."""
        return version_sum(self.versions, offset, nbytes)

    def close(self) -> None:
        """Close the descriptor; the mapping goes when the last tensor view is dropped."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PoolMapping:
    """A client's mapping of a namespace pool received as a descriptor.

    Maps exactly the size the handshake announced (``pool_bytes`` and ``align`` give the file's
    layout; ``fstat`` is not trusted), without ``MAP_POPULATE``: the file is sparse and grows as
    the server commits it, so a client faults in only the pages it touches (the first touch of a
    page costs more than later ones; see docs/server.md), checks the file's seals (a file another client
    could shrink would ``SIGBUS`` every reader), the header's magic, generation and size, and
    closes the descriptor. ``data`` is a uint8 tensor over the entry region; views of it stay
    valid (as memory) after the mapping object is dropped, for as long as they are referenced.
    Raises ``ValueError`` when the file does not look like the announced pool.
    """

    def __init__(self, fd: int, generation: int, pool_bytes: int, data_offset: int, align: int) -> None:
        try:
            if data_offset != HEADER_BYTES:
                raise ValueError(f"unexpected pool data offset {data_offset}")
            if align <= 0 or align & (align - 1) or pool_bytes < 0 or pool_bytes % align:
                raise ValueError(f"unexpected pool layout ({pool_bytes} bytes, alignment {align})")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & SEALS != SEALS:
                raise ValueError("pool file is not sealed against resizing")
            size = pool_file_bytes(pool_bytes, align)
            if os.fstat(fd).st_size != size:
                raise ValueError(f"pool file of {os.fstat(fd).st_size} bytes, announced {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, gen, data_bytes, table_off, shift = _HEADER.unpack_from(mm, 0)
        regions = _regions(pool_bytes)
        if (
            magic != _POOL_MAGIC
            or gen != generation
            or data_bytes != pool_bytes
            or shift != REGION_SHIFT
            or table_off != _table_layout(pool_bytes, align)[0]
        ):
            mm.close()
            raise ValueError("pool header does not match the handshake (magic, generation, size or table)")
        self.generation = generation
        self.pool_bytes = pool_bytes
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=HEADER_BYTES, count=max(pool_bytes, 1))
        #: The server's version table (read only here; see the module docstring).
        self.versions = memoryview(mm)[table_off : table_off + 8 * regions].cast("Q")
        self._mm = mm

    def version(self, offset: int, nbytes: int) -> int:
        """:func:`version_sum` of the mapped table (``offset + nbytes`` inside the pool: the
        caller checked it)."""
        return version_sum(self.versions, offset, nbytes)

    def readonly(self, offset: int, nbytes: int) -> memoryview:
        """A read-only memoryview of ``nbytes`` entry bytes at ``offset`` (``ValueError`` when the
        range leaves the pool)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.pool_bytes:
            raise ValueError(f"range {offset}+{nbytes} leaves the pool of {self.pool_bytes} bytes")
        start = HEADER_BYTES + offset
        return memoryview(self._mm)[start : start + nbytes].toreadonly()

    def header_generation(self) -> int:
        """The generation currently written in the pool's header."""
        gen: int = _HEADER.unpack_from(self._mm, 0)[1]
        return gen
