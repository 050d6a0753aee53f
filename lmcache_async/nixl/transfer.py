"""Moving one record's bytes through NIXL: the registered scratch area and the record transfer.

Everything here runs on the ``nixl`` tier's worker threads, never on the event loop.

A record (:mod:`lmcache_async.records`) travels as header plus payload. The header goes from a
small registered scratch slot; the payload goes straight from/to the registered pool block (or
through the slot's registered bounce area when the block is not registered memory). Payloads move
in pieces of ``chunk_bytes``; each piece is checksummed (xxh3-64) right before it is written or
right after it was read, while it is still in the CPU cache. The header rides in the same request
as the last piece written (its checksum is known only then) and the first piece read (so a wrong
record is rejected early). Where records live is the layouts' job (:mod:`.nixl_io`).

Sealed records (``encryption_key_file``): the payload is cut into segments of ``chunk_bytes``
(the pieces), each stored as AES-256-GCM ciphertext and tag (:mod:`lmcache_async.encryption`).
A piece is never moved from the caller's block as it is then: a write encrypts it into the
slot's registered bounce area (``chunk_bytes`` + 16 bytes) and sends that; a read lands the
stored segment there and decrypts it into the destination. The header (with the seal) rides as
above; a record sealed under another key is :class:`~lmcache_async.records.ForeignSeal`, a tag
that fails a :class:`~lmcache_async.records.RecordError`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash

from lmcache_async.memory import MemoryFormat, MemoryObj, address_view, populate_pages
from lmcache_async.nixl.agent import (
    HEADER_SCRATCH_BYTES,
    NixlAgent,
    NixlTransferError,
    park,
)
from lmcache_async.records import RecordError, RecordHeader, decode_header, encode_header
from lmcache_async.records.sections import TAG_LEN

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

logger = logging.getLogger(__name__)

__all__ = [
    "EntryMeta",
    "Loc",
    "Scratch",
    "ScratchSlot",
    "read_record",
    "write_record",
]


# ---- registered scratch ------------------------------------------------------------------------
@dataclass
class ScratchSlot:
    """One worker's registered scratch: a header area and a bounce area."""

    index: int
    header_ptr: int
    bounce: torch.Tensor
    retired: bool = False

    @property
    def bounce_ptr(self) -> int:
        return int(self.bounce.data_ptr())


class Scratch:
    """``slots`` scratch areas in one buffer registered with the agent once.

    A slot used by a stuck request (:class:`NixlStuckError`) is retired with :meth:`retire`:
    it never goes back to the queue, its memory stays allocated for the life of the process,
    and a freshly registered area takes its place. Thread-safe.
    """

    def __init__(self, agent: NixlAgent, slots: int, bounce_bytes: int) -> None:
        self.stride = HEADER_SCRATCH_BYTES + bounce_bytes
        self.buffer = torch.zeros(slots * self.stride, dtype=torch.uint8)
        populate_pages(self.buffer.data_ptr(), self.buffer.numel())
        base = int(self.buffer.data_ptr())
        self._agent = agent
        self.handle = agent.register_dram(base, self.buffer.numel())
        self._extra: list[tuple[torch.Tensor, object]] = []  # replacement areas and their handles
        self.retired: list[ScratchSlot] = []
        self._lock = threading.Lock()
        self._live = slots
        self._next_index = slots
        self._free: queue.SimpleQueue[ScratchSlot] = queue.SimpleQueue()
        for i in range(slots):
            off = i * self.stride
            bounce = self.buffer[off + HEADER_SCRATCH_BYTES : off + self.stride]
            self._free.put(ScratchSlot(i, base + off, bounce))

    @property
    def live(self) -> int:
        """Slots that can still be handed out (retired ones excluded)."""
        return self._live

    @contextlib.contextmanager
    def slot(self) -> Iterator[ScratchSlot]:
        """A scratch area for the duration of one job (jobs never outnumber slots).

        Raises :class:`NixlTransferError` when every area was retired and none could be
        replaced. A slot retired while held is not given back.
        """
        if self._live <= 0:
            raise NixlTransferError("no NIXL scratch area left (all were used by stuck requests)")
        try:
            s = self._free.get(timeout=60.0)
        except queue.Empty:
            raise NixlTransferError("no NIXL scratch area became free within 60 s") from None
        try:
            yield s
        finally:
            if not s.retired:
                self._free.put(s)

    def retire(self, s: ScratchSlot) -> None:
        """Never reuse ``s`` (a stuck request may still write into it); register a fresh area
        in its place. Registration errors are logged: the tier then has one slot less."""
        with self._lock:
            if s.retired:
                return
            s.retired = True
            self.retired.append(s)
            self._live -= 1
            index = self._next_index
            self._next_index += 1
        try:
            buf = torch.zeros(self.stride, dtype=torch.uint8)
            handle = self._agent.register_dram(int(buf.data_ptr()), buf.numel())
        except Exception as exc:
            logger.error("nixl: no replacement for a retired scratch area: %s", exc)
            return
        with self._lock:
            self._extra.append((buf, handle))
            self._live += 1
        self._free.put(ScratchSlot(index, int(buf.data_ptr()), buf[HEADER_SCRATCH_BYTES:]))

    def close(self) -> None:
        """Deregister the areas. With a retired slot, nothing is deregistered and the memory is
        parked for the life of the process (the stuck request may still use it)."""
        with self._lock:
            extra, self._extra = self._extra, []
            retired = list(self.retired)
        if retired or self._agent.stuck:
            park(self.buffer, *(b for b, _ in extra), *retired)
            return
        self._agent.deregister(self.handle)
        for _, handle in extra:
            self._agent.deregister(handle)


# ---- where the record's bytes are ---------------------------------------------------------------
@dataclass(frozen=True)
class Loc:
    """Registered targets of one record: header at ``(header_dev, header_off)``, payload at
    ``(payload_dev, payload_off)``."""

    header_dev: int
    header_off: int
    payload_dev: int
    payload_off: int


@dataclass(frozen=True)
class EntryMeta:
    """What the index knows of a record (enough to read it without a probe).

    ``payload_len`` is the payload as stored (ciphertext and tags when ``sealed``);
    ``segment_size``: plaintext bytes per sealed segment (0: one segment, or plain)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    header_len: int
    payload_len: int
    sealed: bool = False
    segment_size: int = 0

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len

    @classmethod
    def from_header(cls, h: RecordHeader) -> EntryMeta:
        seal = h.seal
        return cls(h.key, h.shape, h.dtype, h.fmt, h.header_len, h.payload_len, seal is not None,
                   seal.segment_size if seal is not None else 0)  # fmt: skip


def _pieces(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, n - off)) for off in range(0, n, chunk)]


def _flat(obj: MemoryObj) -> torch.Tensor:
    t = obj.tensor
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def write_record(
    agent: NixlAgent,
    slot: ScratchSlot,
    loc: Loc,
    meta: EntryMeta,
    src: MemoryObj,
    src_registered: bool,
    chunk: int,
    piecewise: bool = True,
    cipher: RecordCipher | None = None,
) -> None:
    """Write ``src``'s bytes as a record at ``loc`` (blocking). ``piecewise=False`` writes the
    payload in one request (object stores), which needs ``src_registered``. A ``meta.sealed``
    record is sealed with ``cipher`` through the bounce area (piecewise only)."""
    if meta.sealed:
        if cipher is None or not piecewise:
            raise ValueError("a sealed record needs a cipher and a piecewise layout")
        _write_sealed(agent, slot, loc, meta, src, cipher)
        return
    n = meta.payload_len
    pieces = _pieces(n, chunk) if piecewise else ([(0, n)] if n else [])
    if not src_registered and not piecewise:
        raise ValueError("a one-piece write needs a registered source")
    hasher = xxhash.xxh3_64()
    flat = None if src_registered else _flat(src)
    header_desc: tuple[int, int] | None = None
    if not pieces:
        pieces_iter: list[tuple[int, int] | None] = [None]
    else:
        pieces_iter = list(pieces)
    last = len(pieces_iter) - 1
    for i, piece in enumerate(pieces_iter):
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int, int]] = []
        if piece is not None:
            off, ln = piece
            if flat is None:
                ptr = src.data_ptr + off
            else:
                slot.bounce[:ln].copy_(flat[off : off + ln])
                ptr = slot.bounce_ptr
            hasher.update(address_view(ptr, ln))
            local.append((ptr, ln))
            remote.append((loc.payload_off + off, ln, loc.payload_dev))
        if i == last:
            header = encode_header(meta.key, meta.shape, meta.dtype, meta.fmt, hasher.intdigest())
            if len(header) != meta.header_len or len(header) > HEADER_SCRATCH_BYTES:
                raise RecordError("header length differs from the planned one")
            address_view(slot.header_ptr, len(header))[:] = header
            header_desc = (slot.header_ptr, len(header))
            local.append(header_desc)
            remote.append((loc.header_off, len(header), loc.header_dev))
        agent.transfer("WRITE", local, remote)


def read_record(
    agent: NixlAgent,
    slot: ScratchSlot,
    loc: Loc,
    meta: EntryMeta,
    dst: MemoryObj,
    dst_registered: bool,
    chunk: int,
    cipher: RecordCipher | None = None,
) -> None:
    """Read the record at ``loc`` into ``dst`` and verify it (blocking); a ``meta.sealed``
    record is opened with ``cipher`` through the bounce area.

    Raises :class:`RecordError` when the header does not match ``meta`` (another key, another
    shape), the payload checksum differs or a sealed segment's tag fails
    (:class:`~lmcache_async.records.ForeignSeal` when it is sealed under another key than
    ``cipher``'s); :class:`NixlTransferError` when NIXL fails.
    """
    if meta.sealed:
        if cipher is None:
            raise RecordError("record is sealed and this tier has no key")
        _read_sealed(agent, slot, loc, meta, dst, cipher)
        return
    n = meta.payload_len
    if meta.header_len > HEADER_SCRATCH_BYTES:
        raise RecordError("header larger than the scratch area")
    pieces: list[tuple[int, int] | None] = list(_pieces(n, chunk)) or [None]
    flat = None if dst_registered else _flat(dst)
    hasher = xxhash.xxh3_64()
    header: RecordHeader | None = None
    for i, piece in enumerate(pieces):
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int, int]] = []
        if i == 0:
            local.append((slot.header_ptr, meta.header_len))
            remote.append((loc.header_off, meta.header_len, loc.header_dev))
        ptr = 0
        if piece is not None:
            off, ln = piece
            ptr = dst.data_ptr + off if flat is None else slot.bounce_ptr
            local.append((ptr, ln))
            remote.append((loc.payload_off + off, ln, loc.payload_dev))
        agent.transfer("READ", local, remote)
        if i == 0:
            header = decode_header(address_view(slot.header_ptr, meta.header_len), expect_key=meta.key)
            if EntryMeta.from_header(header) != meta:
                raise RecordError("record header does not match the index")
        if piece is not None:
            off, ln = piece
            hasher.update(address_view(ptr, ln))
            if flat is not None:
                flat[off : off + ln].copy_(slot.bounce[:ln])
    assert header is not None
    if hasher.intdigest() != header.checksum:
        raise RecordError("payload checksum mismatch")


def _layout(meta: EntryMeta, slot: ScratchSlot) -> tuple[int, list[tuple[int, int, int, int]]]:
    """A sealed record's plaintext length and its segments' ``(start, end)`` in the plaintext
    and ``(start, end)`` in the stored payload (checking that a segment fits the bounce area)."""
    seg = meta.segment_size
    count = 1 if seg == 0 else -(-meta.payload_len // (seg + TAG_LEN))
    n = meta.payload_len - count * TAG_LEN
    out = []
    for i in range(count):
        s, e = (0, n) if seg == 0 else (i * seg, min(n, (i + 1) * seg))
        out.append((s, e, s + i * TAG_LEN, e + (i + 1) * TAG_LEN))
    if n < 0 or max(eo - so for _s, _e, so, eo in out) > slot.bounce.numel():
        raise NixlTransferError("a sealed segment does not fit the bounce area (chunk_bytes changed?)")
    return n, out


def _write_sealed(agent: NixlAgent, slot: ScratchSlot, loc: Loc, meta: EntryMeta, src: MemoryObj,
                  cipher: RecordCipher) -> None:  # fmt: skip
    n, segments = _layout(meta, slot)
    if n != src.nbytes:
        raise RecordError("sealed payload length differs from the planned one")
    seal = cipher.new_seal(n, meta.segment_size)
    if seal.segments != len(segments):
        raise RecordError("sealed segments differ from the planned ones")
    plain = src.byte_view() if n else memoryview(b"")
    hasher = xxhash.xxh3_64()
    for i, (s, e, so, eo) in enumerate(segments):
        out = address_view(slot.bounce_ptr, eo - so)
        cipher.seal_segment(seal, meta.key, meta.shape, meta.dtype, meta.fmt, n, i, plain[s:e], out)
        hasher.update(out)
        local = [(slot.bounce_ptr, eo - so)]
        remote = [(loc.payload_off + so, eo - so, loc.payload_dev)]
        if i == len(segments) - 1:  # the header rides with the last segment (its checksum is known now)
            header = encode_header(meta.key, meta.shape, meta.dtype, meta.fmt, hasher.intdigest(), seal=seal)
            if len(header) != meta.header_len or len(header) > HEADER_SCRATCH_BYTES:
                raise RecordError("header length differs from the planned one")
            address_view(slot.header_ptr, len(header))[:] = header
            local.append((slot.header_ptr, len(header)))
            remote.append((loc.header_off, len(header), loc.header_dev))
        agent.transfer("WRITE", local, remote)


def _read_sealed(agent: NixlAgent, slot: ScratchSlot, loc: Loc, meta: EntryMeta, dst: MemoryObj,
                 cipher: RecordCipher) -> None:  # fmt: skip
    if meta.header_len > HEADER_SCRATCH_BYTES:
        raise RecordError("header larger than the scratch area")
    n, segments = _layout(meta, slot)
    if n != dst.nbytes:
        raise RecordError("destination does not hold the record's plaintext")
    plain = dst.byte_view() if n else memoryview(bytearray())
    hasher = xxhash.xxh3_64()
    header: RecordHeader | None = None
    for i, (s, e, so, eo) in enumerate(segments):
        local = [(slot.bounce_ptr, eo - so)]
        remote = [(loc.payload_off + so, eo - so, loc.payload_dev)]
        if header is None:  # the header rides with the first segment (a wrong record stops here)
            local.insert(0, (slot.header_ptr, meta.header_len))
            remote.insert(0, (loc.header_off, meta.header_len, loc.header_dev))
        agent.transfer("READ", local, remote)
        if header is None:
            hview = address_view(slot.header_ptr, meta.header_len)
            header = decode_header(hview, expect_key=meta.key, key_id=cipher.key_id)
            if EntryMeta.from_header(header) != meta:  # so its segments are the ones planned
                raise RecordError("record header does not match the index")
        stored = address_view(slot.bounce_ptr, eo - so)
        hasher.update(stored)
        cipher.open_segment(header, i, stored, plain[s:e])
    assert header is not None
    if hasher.intdigest() != header.checksum:
        raise RecordError("payload checksum mismatch")
