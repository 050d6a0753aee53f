"""The wire side of :class:`~lmcache_async.server.client.ServerClient`: what its requests and
answers look like in bytes, and the copies out of the mapped pool they point at.

Decoding of GET/READ hits, grants, flags, tokens, LIST pages and STATS; the unanswered frames a
client sends on its own (RELEASE, TOUCH); and the copy-out helpers that move a hit's payload
from the mapped pool into a buffer or a caller's sink and check it against the pool's version
table. Nothing here holds the client's lock or state: each helper works on the connection,
mapping or reader it is handed.
"""

from __future__ import annotations

import ctypes
import json
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from lmcache_async.memory import MemoryObj
from lmcache_async.read_sinks import ReadSink
from lmcache_async.server.connection import Connection, copy_bytes, exchange, peer_open
from lmcache_async.server.protocol import (
    FRAME,
    MAX_BATCH,
    EntryMeta,
    Op,
    ProtocolError,
    Reader,
    Writer,
    decode_meta,
    encode_keys,
)
from lmcache_async.server.shm import PoolMapping, version_sum
from lmcache_async.server.views import EntryView

__all__ = [
    "COMMIT_HEAD",
    "HIT",
    "RELEASE_HEAD",
    "TOUCH_BODY",
    "U16",
    "Alloc",
    "Hit",
    "ListedEntry",
    "copy_checked",
    "copy_hits",
    "copy_into",
    "decode_flags",
    "decode_grants",
    "decode_hits",
    "drop_all",
    "flags_of",
    "json_answer",
    "lease_entry",
    "leases_held",
    "list_of",
    "release",
    "splice",
    "spread",
    "tokens_of",
    "touch_frames",
    "ungrant_frame",
]

T = TypeVar("T")

U16 = struct.Struct("<H")
TOUCH_BODY = 1 << 20  # bytes of keys in one TOUCH frame at most (far below MAX_BODY)
HIT = struct.Struct("<BQQ")  # a hit: flag (1 GET, 2 READ), lease id or version, offset (then the metadata)
#: A decoded hit: (lease id or version, offset, metadata).
Hit = tuple[int, int, EntryMeta]
RELEASE_HEAD = struct.Struct("<IBIH")  # frame header of a RELEASE and its count
COMMIT_HEAD = struct.Struct("<QH")  # a COMMIT item: grant id, key length (then key, metadata)

#: Where a copy goes: ``alloc(shape, dtype, fmt)`` gives a buffer (one reference, the caller's) or None.
Alloc = Callable[[Sequence[int], torch.dtype, Any], "MemoryObj | None"]


def ungrant_frame(gids: Sequence[int]) -> bytes:
    """An unanswered UNGRANT frame giving back the cached grants ``gids``."""
    w = Writer().u16(len(gids))
    for gid in gids:
        w.u64(gid)
    return w.frame(Op.UNGRANT, 0)


def lease_entry(conn: Connection, deadline: float, key: bytes, pre: bytes, started: float) -> EntryView | None:
    """One GET of ``key`` (carrying the pending frames ``pre``): a zero-copy view of the entry
    under its lease, or None for a miss. ``started``: a time before the request was sent (the
    server's lease TTL starts later than this)."""
    r = Reader(exchange(conn, Op.GET, encode_keys([key]), deadline, pre))
    if r.u16() != 1:
        raise ProtocolError("GET answer has the wrong count")
    if not r.u8():
        r.done()
        return None
    lid, off = r.u64(), r.u64()
    meta = r.meta()
    r.done()
    assert conn.mapping is not None
    if off + meta.nbytes > conn.mapping.pool_bytes:
        release(conn, [lid])
        raise ProtocolError("GET answer points outside the pool")
    return EntryView(conn, lid, off, meta, started + conn.ttl_s)


def decode_hits(v: memoryview, n: int, pool_bytes: int, flag: int, what: str) -> list[Hit | None]:
    """The ``n`` entries of a GET (``flag`` 1: lease id) or READ (2: version) answer: per key
    None for a miss or (lease id or version, offset, metadata); :class:`ProtocolError` for an
    answer that is malformed or points outside the pool."""
    if len(v) < 2 or U16.unpack_from(v, 0)[0] != n:
        raise ProtocolError(f"{what} answer has the wrong count")
    end = len(v)
    pos = 2
    out: list[Hit | None] = []
    for _ in range(n):
        if pos >= end:
            raise ProtocolError("message truncated")
        if not v[pos]:
            pos += 1
            out.append(None)
            continue
        if pos + HIT.size > end:
            raise ProtocolError("message truncated")
        got, ident, off = HIT.unpack_from(v, pos)
        if got != flag:
            raise ProtocolError(f"{what} answer has hit flag {got}")
        meta, pos = decode_meta(v, pos + HIT.size)
        if off + meta.nbytes > pool_bytes:
            raise ProtocolError(f"{what} answer points outside the pool")
        out.append((ident, off, meta))
    if pos != end:
        raise ProtocolError(f"{end - pos} trailing bytes")
    return out


def copy_hits(mapping: PoolMapping, hits: Sequence[Hit | None], alloc: Alloc) -> list[MemoryObj | None]:
    """Each hit copied from the mapped pool into a buffer from ``alloc`` (None per miss or
    buffer refused); on an exception nothing is kept."""
    data = mapping.data
    base = data.data_ptr()
    out: list[MemoryObj | None] = []
    try:
        for hit in hits:
            obj = None
            if hit is not None:
                _ident, off, meta = hit
                obj = alloc(meta.shape, meta.dtype, meta.fmt)
                if obj is not None and meta.nbytes:
                    copy_bytes(obj.tensor, base + off, data, off, meta.nbytes, out_of_pool=True)
            out.append(obj)
    except BaseException:
        drop_all(out)
        raise
    return out


def copy_checked(
    mapping: PoolMapping, hits: Sequence[Hit | None], alloc: Alloc
) -> tuple[list[MemoryObj | None], list[int]]:
    """Each lease-free hit ``(version, offset, metadata)`` copied out (:func:`copy_hits`), then
    checked against the mapped version table: a copy whose entry left the index meanwhile is
    given back (None in the result) and its index listed, in order, as stale."""
    out = copy_hits(mapping, hits, alloc)
    versions = mapping.versions
    stale: list[int] = []
    for i, hit in enumerate(hits):
        obj = out[i]
        if hit is not None and obj is not None and version_sum(versions, hit[1], hit[2].nbytes) != hit[0]:
            obj.ref_count_down()
            out[i] = None
            stale.append(i)
    return out, stale


def leases_held(conn: Connection, until: float) -> bool:
    """Whether leases taken on ``conn`` after ``until - ttl`` still held once a copy under them
    ended: the TTL had not passed by our clock (the server starts it later and frees a block at
    its expiry at the earliest) and the server had not closed the connection (the only other way
    it ends a lease). A reader stalled past either, for any length of time, is told so."""
    return time.monotonic() < until and peer_open(conn)


def copy_into(sink: ReadSink, src: int) -> None:
    """Copy a payload at address ``src`` of the mapped pool into ``sink``'s pieces, in order."""
    for addr, n in sink.pieces:
        ctypes.memmove(addr, src, n)
        src += n


def splice(out: list[MemoryObj | None], at: Sequence[int], got: Sequence[MemoryObj | None]) -> None:
    """Put ``got[j]`` at ``out[at[j]]``, giving back the buffer it replaces."""
    for i, obj in zip(at, got, strict=True):
        old, out[i] = out[i], obj
        if old is not None:
            old.ref_count_down()


def drop_all(objs: Sequence[MemoryObj | None]) -> None:
    """Give back one reference of each buffer (a call that fails keeps none)."""
    for o in objs:
        if o is not None:
            o.ref_count_down()


def release(conn: Connection, leases: Sequence[int]) -> None:
    """End leases with one unanswered RELEASE. A send that fails leaves the connection to the
    next call (which finds it closed and reconnects); the server reclaims the leases of a
    connection that goes away, so nothing stays pinned."""
    n = len(leases)
    frame = RELEASE_HEAD.pack(2 + 8 * n, Op.RELEASE, 0, n) + struct.pack(f"<{n}Q", *leases)
    try:
        conn.sock.sendall(frame)
    except OSError:
        conn.close()  # a frame may be half sent: this connection cannot be used again


def touch_frames(keys: list[bytes]) -> bytes:
    """Unanswered TOUCH frames for ``keys``, each within the batch and body limits."""
    frames: list[bytes] = []
    start, size = 0, 0
    for i, k in enumerate(keys):
        if i - start == MAX_BATCH or size + 2 + len(k) > TOUCH_BODY:
            frames.append(encode_keys(keys[start:i]))
            start, size = i, 0
        size += 2 + len(k)
    frames.append(encode_keys(keys[start:]))
    return b"".join(FRAME.pack(len(body), Op.TOUCH, 0) + body for body in frames)


def flags_of(conn: Connection, r: Reader, n: int) -> list[bool]:
    return decode_flags(r, n)


def tokens_of(conn: Connection, r: Reader, n: int) -> list[int]:
    if r.u16() != n:
        raise ProtocolError("HOLD answer has the wrong count")
    return [r.u64() for _ in range(n)]


def decode_flags(r: Reader, n: int) -> list[bool]:
    if r.u16() != n:
        raise ProtocolError("answer has the wrong count")
    return [bool(r.u8()) for _ in range(n)]


def decode_grants(r: Reader, n: int, pool_bytes: int) -> list[tuple[int, int] | None]:
    if r.u16() != n:
        raise ProtocolError("grant answer has the wrong count")
    out: list[tuple[int, int] | None] = []
    for _ in range(n):
        gid, off, size = r.u64(), r.u64(), r.u64()
        if gid == 0:
            out.append(None)
            continue
        if off + size > pool_bytes:
            raise ProtocolError("grant points outside the pool")
        out.append((gid, off))
    return out


class ListedEntry(NamedTuple):
    """One entry of a LIST page: key, metadata, pool block size, and whether a lease or hold
    pins it."""

    key: bytes
    meta: EntryMeta
    block_bytes: int
    pinned: bool


def list_of(conn: Connection, r: Reader) -> tuple[list[ListedEntry], bool]:
    out = [ListedEntry(r.blob(), r.meta(), r.u64(), bool(r.u8())) for _ in range(r.u16())]
    return out, bool(r.u8())


def json_answer(r: Reader) -> dict[str, Any]:
    try:
        out = json.loads(r.rest())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"stats answer is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ProtocolError("stats answer is not an object")
    return out


def spread(fit: list[int], got: list[T] | None, n: int, absent: T) -> list[T] | None:
    """The answers ``got`` for the keys at indices ``fit``, spread over ``n`` places with
    ``absent`` at the others; None stays None."""
    if got is None:
        return None
    out = [absent] * n
    for i, v in zip(fit, got, strict=True):
        out[i] = v
    return out
