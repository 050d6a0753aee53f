"""The node cache server's request handlers: one handler per :class:`~lmcache_async.server.protocol.Op`.

:class:`RequestHandlers` maps each op to the coroutine that reads its request body and returns
its answer body (None: the op is never answered), and gives the connection's fast path the
handlers of the hot requests that never wait. A request whose entries are missing from the pool
may be staged from the server's lower tiers (:meth:`RequestHandlers.stage`); committed entries
are written through to them. Everything runs on the server's event loop, one request of a
connection at a time.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import struct
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import torch

from lmcache_async.memory import MemoryObj
from lmcache_async.server.frames import Conn
from lmcache_async.server.growth import WAIT_S
from lmcache_async.server.keycheck import checked_key
from lmcache_async.server.namespace import ClientState, Namespace
from lmcache_async.server.protocol import (
    COMMIT_STORED,
    LIST_PAGE_BYTES,
    MAX_HOLD_TTL_S,
    MAX_LIST_PAGE,
    EntryMeta,
    Op,
    Reader,
    Writer,
    encode_meta,
)

if TYPE_CHECKING:
    from lmcache_async.server.server import CacheServer

__all__ = ["Handler", "RequestHandlers"]

_U16 = struct.Struct("<H")
_HIT = struct.Struct("<BQQ")  # an answer's hit: flag (1 GET, 2 READ), lease id or version, offset (then metadata)

#: A request handler: the admitted connection and a reader of the request body to the answer
#: body (None: the request is not answered).
Handler = Callable[[Conn, Reader], Coroutine[Any, Any, "bytes | None"]]


class RequestHandlers:
    """The handlers of one :class:`~lmcache_async.server.server.CacheServer`'s requests, by op.

    :meth:`dispatch` runs the handler of a request's op (see there); each reads the server's
    lower tiers, pool growth and events as they are when the request runs.
    """

    def __init__(self, server: CacheServer) -> None:
        self._server = server
        #: The handler of each op.
        self.table: dict[Op, Handler] = {
            Op.PING: self._ping,
            Op.STATS: self._stats,
            Op.CONTAINS: self._contains,
            Op.READ: self._read,
            Op.GET: self._get,
            Op.RELEASE: self._release,
            Op.TOUCH: self._touch,
            Op.GRANT: self._grant,
            Op.COMMIT: self._commit,
            Op.UNGRANT: self._ungrant,
            Op.REMOVE: self._remove,
            Op.CLEAR: self._clear,
            Op.HOLD: self._hold,
            Op.UNHOLD: self._unhold,
            Op.LIST: self._list,
            Op.DESCRIBE: self._describe,
            Op.GET_HELD: self._get_held,
        }

    def dispatch(self, conn: Conn, op: Op, r: Reader) -> Coroutine[Any, Any, bytes | None]:
        """The coroutine that answers a request of ``op`` on ``conn``: its answer body (None: not
        answered). PING and STATS are for any connection; every other op needs one admitted to a
        namespace (an ``AssertionError`` otherwise), and an op with no handler is answered with an
        empty body."""
        return self.table.get(op, self._unhandled)(conn, r)

    async def _unhandled(self, conn: Conn, r: Reader) -> bytes | None:
        _admitted(conn)
        return b""

    def fast(self) -> dict[int, Callable[[Conn, Reader], bytes | None]]:
        """Handlers of the hot requests that never wait (presence, reads and releases, when the
        server has no lower tiers), by op code, for the connection's fast path: each takes the
        admitted connection and a reader of the request body and returns the answer body
        (None: the request is not answered)."""
        if self._server.lower is not None:
            return {}

        def contains(conn: Conn, r: Reader) -> bytes:
            assert conn.ns is not None
            flags = _contains(conn.ns, r)[1]
            return _U16.pack(len(flags)) + bytes(flags)

        def read(conn: Conn, r: Reader) -> bytes:
            assert conn.ns is not None
            return _read_answer(_locate(conn.ns, r)[1])

        def get(conn: Conn, r: Reader) -> bytes:
            assert conn.ns is not None and conn.state is not None
            return _lease_answer(_lease(conn.ns, conn.state, r)[1])

        def release(conn: Conn, r: Reader) -> None:
            assert conn.ns is not None and conn.state is not None
            _release(conn.ns, conn.state, r)

        return {int(Op.CONTAINS): contains, int(Op.READ): read, int(Op.GET): get, int(Op.RELEASE): release}

    # ---- any connection -------------------------------------------------------------------------------
    async def _ping(self, conn: Conn, r: Reader) -> bytes | None:
        r.done()
        return b""

    async def _stats(self, conn: Conn, r: Reader) -> bytes | None:
        r.done()
        return json.dumps(self._server.stats(conn), sort_keys=True, default=str).encode()

    # ---- reads --------------------------------------------------------------------------------------
    async def _contains(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        lower = self._server.lower
        keys, flags, pool_only = _contains(ns, r)
        if lower is not None and not pool_only and not all(flags):
            missing = [i for i, f in enumerate(flags) if not f]
            found = await lower.contains(ns.name, [keys[i] for i in missing])
            for i, f in zip(missing, found, strict=True):
                flags[i] = f
        return _U16.pack(len(flags)) + bytes(map(bool, flags))

    async def _read(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        keys, located = _locate(ns, r, count_miss=self._server.lower is None)
        if self._server.lower is not None:
            for i, loc in enumerate(located):
                if loc is None and await self.stage(ns, keys[i]):
                    located[i] = ns.locate(keys[i])
        return _read_answer(located)

    async def _get(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        keys, leased = _lease(ns, st, r, count_miss=self._server.lower is None)
        if self._server.lower is not None:
            for i, lease in enumerate(leased):
                if lease is None and await self.stage(ns, keys[i]):
                    leased[i] = ns.lease(st, keys[i])
        return _lease_answer(leased)

    async def _release(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        _release(ns, st, r)
        return None

    async def _touch(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        keys = r.keys()
        r.done()
        ns.touch(keys)
        return None

    async def _get_held(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        tokens = [r.u64() for _ in range(r.count())]
        r.done()
        return _lease_answer([ns.lease_held(st, token) for token in tokens])

    # ---- writes -------------------------------------------------------------------------------------
    async def _grant(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        w = Writer()
        growth = self._server.growth
        sizes = [r.u64() for _ in range(r.count())]
        r.done()
        if growth.short(ns.pool):
            await self._grants_growing(ns, st, sizes, w)
        else:
            _grants(ns, st, sizes, w)
        growth.maybe_grow(ns.pool)
        return w.body()

    async def _commit(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        w = Writer()
        n = r.count()
        commits = []
        for _ in range(n):
            gid = r.u64()
            key = r.blob()
            meta = r.meta()
            commits.append((gid, checked_key(key), meta))
        sizes = [r.u64() for _ in range(r.count())]
        r.done()
        w.u16(len(commits))
        for gid, key, meta in commits:
            res = ns.commit(st, gid, key, meta)
            w.u8(res)
            if res == COMMIT_STORED and self._server.lower is not None:
                await self._write_through(ns, key)
        _grants(ns, st, sizes, w)
        self._server.growth.maybe_grow(ns.pool)
        return w.body()

    async def _ungrant(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        for _ in range(r.count()):
            ns.ungrant(st, r.u64())
        r.done()
        return None

    async def _remove(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        w = Writer()
        keys = r.keys()
        r.done()
        w.u16(len(keys))
        for k in keys:
            removed = ns.remove(k)
            if self._server.lower is not None:
                removed = await self._server.lower.remove(ns.name, k) or removed
            w.u8(removed)
        return w.body()

    async def _clear(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        w = Writer()
        r.done()
        ns.clear()
        lower = self._server.lower
        uncleared = await lower.clear(ns.name) if lower is not None else []
        w.u16(len(uncleared))
        for name in uncleared:
            w.blob(name.encode())
        return w.body()

    # ---- holds, listing, events -----------------------------------------------------------------------
    async def _hold(self, conn: Conn, r: Reader) -> bytes | None:
        ns, st = _admitted(conn)
        lower = self._server.lower
        w = Writer()
        ttl_s = min(r.u32() / 1000.0, MAX_HOLD_TTL_S)
        keys = r.keys()
        r.done()
        w.u16(len(keys))
        for k in keys:
            token = ns.hold(k, ttl_s, st)
            if token is None and lower is not None and ns.entry_view(k) is None and await self.stage(ns, k):
                token = ns.hold(k, ttl_s, st)  # an entry only a lower tier had, now back in the pool
            w.u64(token or 0)
        return w.body()

    async def _unhold(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        for _ in range(r.count()):
            ns.unhold(r.u64())
        r.done()
        return None

    async def _list(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        after, prefix = r.blob(), r.blob()
        limit = min(r.u16(), MAX_LIST_PAGE)
        r.done()
        page, more = ns.list_page(after, prefix, limit)
        parts = [b""]
        size = 0
        n = 0
        for key, block, meta, pinned in page:
            if size > LIST_PAGE_BYTES:
                more = True
                break
            item = Writer().blob(key).meta(meta).u64(block).u8(pinned).body()
            parts.append(item)
            size += len(item)
            n += 1
        parts[0] = _U16.pack(n)
        parts.append(bytes([more]))
        return b"".join(parts)

    async def _describe(self, conn: Conn, r: Reader) -> bytes | None:
        ns, _st = _admitted(conn)
        events = self._server.events
        return events.describe(ns, r) if events is not None else _unrecorded(r)

    # ---- the lower tiers and pool growth ------------------------------------------------------------------
    async def _write_through(self, ns: Namespace, key: bytes) -> None:
        lower = self._server.lower
        assert lower is not None
        got = ns.entry_view(key)
        if got is None:
            return
        obj, meta = got
        view = ns.pool.buffer[obj.offset : obj.offset + meta.nbytes]
        tensor = view.view(meta.dtype).view(meta.shape) if meta.nbytes else torch.empty(meta.shape, dtype=meta.dtype)
        await lower.put(ns.name, key, tensor, meta.fmt)

    async def stage(self, ns: Namespace, key: bytes) -> bool:
        """Read a pool miss from the lower tiers into the pool's index: False (counted as a
        miss) when no lower tier has it or no block is free for it."""
        lower, growth = self._server.lower, self._server.growth
        assert lower is not None
        obj = await lower.get(ns.name, key)
        if obj is None:
            ns.misses += 1
            return False
        try:
            if ns.entry_view(key) is None:  # nobody committed it while we read
                meta = EntryMeta.of(obj.shape, obj.dtype, obj.fmt)
                block = ns.allocate_block(meta.nbytes)
                if block is None and ns.pool.can_grow:
                    await growth.wait_room(ns.pool, asyncio.get_running_loop().time() + WAIT_S)
                    block = ns.allocate_block(meta.nbytes)
                growth.maybe_grow(ns.pool)
                if block is None:
                    ns.misses += 1
                    return False
                if meta.nbytes:
                    ctypes.memmove(block.data_ptr, obj.data_ptr, meta.nbytes)
                if not ns.insert(key, block, meta):
                    block.ref_count_down()
                ns.loaded += 1
        finally:
            obj.ref_count_down()
        return True

    async def _grants_growing(self, ns: Namespace, st: ClientState, sizes: list[int], w: Writer) -> None:
        """:func:`_grants` for a pool short of committed room: a size that finds no block waits
        for the pool's next step (at most :data:`~lmcache_async.server.growth.WAIT_S` for the
        whole request) and is asked again; refused when the pool cannot grow."""
        growth = self._server.growth
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        w.u16(len(sizes))
        for size in sizes:
            ok = 0 < size <= ns.pool.capacity and len(st.grants) < ns.max_grants
            got = ns.grant(st, size, count_refusal=False) if ok else None
            while ok and got is None and ns.pool.can_grow and await growth.wait_room(ns.pool, deadline):
                got = ns.grant(st, size, count_refusal=False)
            if got is None:
                ns.refused_grants += 1
                w.u64(0).u64(0).u64(0)
            else:
                gid, obj = got
                w.u64(gid).u64(obj.offset).u64(obj.size)


def _grants(ns: Namespace, st: ClientState, sizes: list[int], w: Writer) -> None:
    """Grant a block of each size in ``sizes`` to ``st`` (zeros for one refused), into ``w``."""
    w.u16(len(sizes))
    for size in sizes:
        got = ns.grant(st, size) if 0 < size <= ns.pool.capacity else None
        if got is None:
            w.u64(0).u64(0).u64(0)
        else:
            gid, obj = got
            w.u64(gid).u64(obj.offset).u64(obj.size)


def _admitted(conn: Conn) -> tuple[Namespace, ClientState]:
    """The namespace and client state of a connection admitted to a namespace (asserted)."""
    ns, st = conn.ns, conn.state
    assert ns is not None and st is not None
    return ns, st


def _contains(ns: Namespace, r: Reader) -> tuple[list[bytes], list[bool], bool]:
    """A CONTAINS body's keys, their presence in the pool, and whether the client asked about the
    pool only (flag bit 1; bit 0 touches the entries): then the lower tiers are not asked."""
    head = r.u8()
    keys = r.keys()
    r.done()
    return keys, ns.contains(keys, bool(head & 1)), bool(head & 2)


def _locate(
    ns: Namespace, r: Reader, *, count_miss: bool = True
) -> tuple[list[bytes], list[tuple[int, int, EntryMeta] | None]]:
    """A READ body's keys and where each lies in the pool (None: not in the pool)."""
    keys = r.keys()
    r.done()
    return keys, [ns.locate(k, count_miss=count_miss) for k in keys]


def _lease(
    ns: Namespace, st: ClientState, r: Reader, *, count_miss: bool = True
) -> tuple[list[bytes], list[tuple[int, MemoryObj, EntryMeta] | None]]:
    """A GET body's keys, each leased for ``st`` (None: not in the pool, or refused)."""
    keys = r.keys()
    r.done()
    return keys, [ns.lease(st, k, count_miss=count_miss) for k in keys]


def _lease_answer(leased: list[tuple[int, MemoryObj, EntryMeta] | None]) -> bytes:
    """A GET or GET_HELD answer of leases ``(lease id, block, metadata)``."""
    return _hits_answer(1, [None if g is None else (g[0], g[1].offset, g[2]) for g in leased])


def _hits_answer(flag: int, hits: list[tuple[int, int, EntryMeta] | None]) -> bytes:
    """A GET (``flag`` 1: lease id) or READ (2: version) answer: per key 0 for a miss, else the
    flag, the id or version, the offset and the metadata."""
    parts = [_U16.pack(len(hits))]
    for hit in hits:
        if hit is None:
            parts.append(b"\x00")
            continue
        ident, offset, meta = hit
        parts.append(_HIT.pack(flag, ident, offset))
        parts.append(encode_meta(meta))
    return b"".join(parts)


def _unrecorded(r: Reader) -> bytes:
    """The answer to a ``DESCRIBE`` when the server publishes no events: nothing recorded."""
    n = r.count()
    for _ in range(n * 4):
        r.blob(0xFFFF)
    r.done()
    return _U16.pack(n) + bytes(n)


def _release(ns: Namespace, st: ClientState, r: Reader) -> None:
    """End the leases a RELEASE body names (unknown ones are ignored); never answered."""
    for _ in range(r.count()):
        ns.release(st, r.u64())
    r.done()


def _read_answer(located: list[tuple[int, int, EntryMeta] | None]) -> bytes:
    return _hits_answer(2, located)
