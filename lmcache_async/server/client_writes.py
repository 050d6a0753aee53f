"""The write path of :class:`~lmcache_async.server.client.ServerClient`: blocks granted, payloads
copied in, entries committed.

A put takes a block per payload from the connection's cache of pre-granted blocks, asks for the
rest with one GRANT, copies each payload into the mapped pool, and commits them all with one
COMMIT that also refills the pre-grant cache (so the next put of the same sizes is one round
trip). Runs under the client's lock on the connection it is handed.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

from lmcache_async.memory import MemoryObj
from lmcache_async.server.client_wire import COMMIT_HEAD, U16, decode_grants
from lmcache_async.server.connection import Connection, copy_bytes, exchange
from lmcache_async.server.protocol import COMMIT_FAILED, EntryMeta, Op, ProtocolError, Reader, Writer, encode_meta

__all__ = ["PREGRANT_PER_SIZE", "PREGRANT_TOTAL", "refill_sizes", "store"]

#: Pre-granted blocks kept per block size, and in all (a put into one of them is one round trip).
PREGRANT_PER_SIZE = 2
PREGRANT_TOTAL = 16


def store(
    conn: Connection, deadline: float, items: Sequence[tuple[bytes, MemoryObj]], metas: list[EntryMeta], pre: bytes
) -> list[bool]:
    """Store ``items`` (their metadata ``metas``) on ``conn`` under the client's lock: each
    payload copied into a cached pre-granted block or one granted now (one GRANT round trip
    for those missing, carrying the pending frames ``pre``), then committed with one COMMIT
    that also asks for the pre-grants to refill (:func:`refill_sizes`). Per item True when
    stored or already present; False when no block was granted or the commit failed."""
    assert conn.mapping is not None
    sizes = [conn.block_size(m.nbytes) for m in metas]
    blocks: list[tuple[int, int] | None] = []
    missing: list[int] = []
    for i, size in enumerate(sizes):
        lst = conn.grants.get(size)
        if lst:
            gid, off, _exp = lst.pop()
            blocks.append((gid, off))
        else:
            blocks.append(None)
            missing.append(i)
    if missing:
        w = Writer().u16(len(missing))
        for i in missing:
            w.u64(sizes[i])
        r = Reader(exchange(conn, Op.GRANT, w.body(), deadline, pre))
        pre = b""
        got = decode_grants(r, len(missing), conn.mapping.pool_bytes)
        r.done()
        for i, g in zip(missing, got, strict=True):
            blocks[i] = None if g is None else (g[0], g[1])
    data = conn.mapping.data
    base = data.data_ptr()
    committed = [i for i, b in enumerate(blocks) if b is not None]
    parts = [U16.pack(len(committed))]
    for i in committed:
        gid, off = blocks[i]  # type: ignore[misc]
        n = metas[i].nbytes
        if n:
            copy_bytes(items[i][1].tensor, base + off, data, off, n, out_of_pool=False)
        key = items[i][0]
        parts.append(COMMIT_HEAD.pack(gid, len(key)))
        parts.append(key)
        parts.append(encode_meta(metas[i]))
    refill = refill_sizes(conn, [sizes[i] for i in committed])
    parts.append(U16.pack(len(refill)))
    parts.append(struct.pack(f"<{len(refill)}Q", *refill))
    r = Reader(exchange(conn, Op.COMMIT, b"".join(parts), deadline, pre))
    if r.u16() != len(committed):
        raise ProtocolError("COMMIT answer has the wrong count")
    results = [r.u8() for _ in committed]
    now = time.monotonic()
    for s, g in zip(refill, decode_grants(r, len(refill), conn.mapping.pool_bytes), strict=True):
        if g is not None:
            expiry = now + conn.ttl_s / 2
            conn.grants.setdefault(s, []).append((g[0], g[1], expiry))
            conn.grants_checked_until = min(conn.grants_checked_until, expiry)
    r.done()
    out = [False] * len(items)
    for i, res in zip(committed, results, strict=True):
        out[i] = res != COMMIT_FAILED
    return out


def refill_sizes(conn: Connection, used: list[int]) -> list[int]:
    """The block sizes to ask pre-grants for after a put that used blocks of sizes ``used``: up to
    :data:`PREGRANT_PER_SIZE` cached per size and :data:`PREGRANT_TOTAL` in all."""
    want: list[int] = []
    total = conn.cached_grants()
    for s in dict.fromkeys(used):
        have = len(conn.grants.get(s, ()))
        k = min(PREGRANT_PER_SIZE - have, PREGRANT_TOTAL - total)
        if k > 0:
            want.extend([s] * k)
            total += k
    return want
