"""The client side of the node cache server: one blocking connection, shared by threads.

:class:`ServerClient` talks to ``lmcache-async serve`` over its Unix socket and reads and writes
payloads through the mapped namespace pool. Every public method may be called from any thread;
calls are serialised on one connection, each bounded by ``timeout_s`` (the wait for the
connection's lock included), and none raises for trouble: a server that is down, slow, restarted
or answering nonsense is a ``None`` answer ("could not tell"), counted, logged at a limited
rate, and fed to a circuit breaker. While the breaker is open calls answer ``None`` at once;
the next allowed call reconnects and maps the (new) pool.

Generations: every connection maps the pool it was handed at its handshake and checks the
pool's generation there; grants and leases belong to one connection, so a reply of a restarted
server can never point into a pool mapped from its predecessor. A call that finds its
connection closed by the server (stopped or restarted since the last call) reconnects and maps
the new pool within its own timeout, so the first call after a restart is answered.

Reads: :meth:`ServerClient.get` copies each entry out (the caller keeps the copy) with no
lease: one READ round trip says where the entry lies, or none at all for an entry this
connection read before (it remembers the location; ``remember_locations``). Every copy is
checked against the pool's version table afterwards (:mod:`lmcache_async.server.shm`): one whose
entry left the index meanwhile is asked again, so a copy never holds another entry's bytes.
:meth:`ServerClient.get_view` lends a zero-copy view under a lease for callers that do not keep
it. Holds (:meth:`ServerClient.hold`) pin entries for readers in other processes.

Layout: this module holds the operations; the connection, its lock, reconnects and counters are
:mod:`~lmcache_async.server.client_session`'s, the bytes on the wire and the copies out of the
pool :mod:`~lmcache_async.server.client_wire`'s, and the write path (grants, copy-in, commit)
:mod:`~lmcache_async.server.client_writes`'s.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from lmcache_async.memory import MemoryObj
from lmcache_async.read_sinks import ReadSink
from lmcache_async.server.client_session import ClientSession
from lmcache_async.server.client_wire import U16 as _U16
from lmcache_async.server.client_wire import Alloc, Hit, ListedEntry
from lmcache_async.server.client_wire import copy_checked as _copy_checked
from lmcache_async.server.client_wire import copy_hits as _copy_hits
from lmcache_async.server.client_wire import copy_into as _copy_into
from lmcache_async.server.client_wire import decode_hits as _hits
from lmcache_async.server.client_wire import drop_all as _drop_all
from lmcache_async.server.client_wire import flags_of as _flags_of
from lmcache_async.server.client_wire import json_answer as _json
from lmcache_async.server.client_wire import lease_entry as _lease_entry
from lmcache_async.server.client_wire import leases_held as _leases_held
from lmcache_async.server.client_wire import list_of as _list_of
from lmcache_async.server.client_wire import release as _release
from lmcache_async.server.client_wire import splice as _splice
from lmcache_async.server.client_wire import spread as _spread
from lmcache_async.server.client_wire import tokens_of as _tokens_of
from lmcache_async.server.client_wire import touch_frames as _touch_frames  # noqa: F401 (tests import it here)
from lmcache_async.server.client_writes import PREGRANT_PER_SIZE, PREGRANT_TOTAL  # noqa: F401 (importable here)
from lmcache_async.server.client_writes import store as _store
from lmcache_async.server.connection import Connection as _Connection
from lmcache_async.server.connection import ServerUnavailable
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.connection import exchange as _exchange
from lmcache_async.server.connection import peer_open as _peer_open
from lmcache_async.server.connection import send_frames as _send_frames
from lmcache_async.server.protocol import (
    MAX_BATCH,
    MAX_KEY_BYTES,
    MAX_LIST_PAGE,
    EntryMeta,
    Mode,
    Op,
    ProtocolError,
    Reader,
    Writer,
    encode_keys,
)
from lmcache_async.server.shm import OPTIMISTIC_READS, version_sum
from lmcache_async.server.views import EntryView

__all__ = ["EntryView", "ListedEntry", "ServerClient", "ServerUnavailable", "query_status"]

#: Entry locations a connection remembers for reads with no round trip (oldest dropped first).
LOCATIONS_MAX = 8192
#: Reads from remembered locations reported in one TOUCH at the latest (else on the next request).
TOUCH_BATCH = 64


class ServerClient(ClientSession):
    """A thread-safe client of one namespace on a cache server; see the module docstring.

    ``None`` from any call means the server could not be asked (down, timed out, breaker open,
    malformed answer); other answers are the server's. Buffers returned by :meth:`get` come
    from ``alloc`` and are owned by the caller (one reference each). ``remember_locations``
    (default on) lets :meth:`get` copy an entry it read before straight from where it lies,
    with no round trip, while the pool's version table shows it still indexed there. The
    connection, the counters, :meth:`stats` and :meth:`close` are
    :class:`~lmcache_async.server.client_session.ClientSession`'s.
    """

    # ---- operations --------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes], touch: bool = False, pool_only: bool = False) -> list[bool] | None:
        """Presence of each key (one round trip for the batch); a key longer than
        :data:`MAX_KEY_BYTES` (which no server stores) is absent. ``pool_only``: presence in the
        server's shared pool only (its own lower tiers are not asked)."""
        if not keys:
            return []
        if (fit := self._fitting(keys)) is not None:
            return _spread(fit, self.contains([keys[i] for i in fit], touch, pool_only), len(keys), False)
        head = bytes([int(touch) | (2 if pool_only else 0)])
        out: list[bool] = []
        for i in range(0, len(keys), MAX_BATCH):
            part = keys[i : i + MAX_BATCH]
            got = self._locked("CONTAINS", self._flags_locked, Op.CONTAINS, encode_keys(part, head), len(part))
            if got is None:
                return None
            out.extend(got)
        return out

    def describe(self, items: Sequence[tuple[bytes, Any]]) -> list[bool] | None:
        """Tell the server what committed entries hold in vLLM's terms (``DESCRIBE``, protocol
        4): ``(key, chunk)`` pairs, each chunk a :class:`~lmcache_async.events.chunks.Chunk`
        (needs msgspec, the ``events`` extra). Per entry whether the server recorded it (one it
        does not hold, or a server without ``--events``, records nothing; a recorded entry is
        published on its KV-event stream); None when the server could not be asked. One round
        trip per :data:`MAX_BATCH` entries."""
        from lmcache_async.events.describe import encode_describe

        out: list[bool] = []
        for i in range(0, len(items), MAX_BATCH):
            part = items[i : i + MAX_BATCH]
            got = self._locked("DESCRIBE", self._flags_locked, Op.DESCRIBE, encode_describe(part), len(part))
            if got is None:
                return None
            out.extend(got)
        return out

    def _flags_locked(self, conn: _Connection, deadline: float, op: Op, body: bytes, n: int) -> list[bool]:
        """One request answered by a u16 count and one u8 flag per key."""
        v = _exchange(conn, op, body, deadline, self._pending(conn))
        if len(v) != 2 + n or _U16.unpack_from(v, 0)[0] != n:
            raise ProtocolError("answer has the wrong count")
        return [b != 0 for b in v[2:]]

    def get(self, keys: Sequence[bytes], alloc: Alloc) -> list[MemoryObj | None] | None:
        """Each entry copied into a buffer from ``alloc`` (the caller owns it), None per miss.

        One round trip (``READ``) answers where the batch lies (none for entries whose
        location this connection remembers); the copies run on this thread from the mapped pool
        and are checked against the pool's version table afterwards
        (:mod:`lmcache_async.server.shm`): an entry that left the index meanwhile is asked again
        (a remembered one with ``READ``; a ``READ`` answer under a lease, ``GET`` then one
        unanswered RELEASE), so no copy ever holds bytes of another entry. Where lease-free
        reads are not safe (:data:`OPTIMISTIC_READS`) every read is leased. A buffer ``alloc``
        cannot provide is a miss, and so is a key longer than :data:`MAX_KEY_BYTES`.
        """
        if not keys:
            return []
        if (fit := self._fitting(keys)) is not None:
            return _spread(fit, self.get([keys[i] for i in fit], alloc), len(keys), None)
        read = self._read_locked if OPTIMISTIC_READS else self._get_keys_locked
        if len(keys) <= MAX_BATCH:
            return self._locked("GET", read, keys, alloc)
        out: list[MemoryObj | None] = []
        for i in range(0, len(keys), MAX_BATCH):
            part = keys[i : i + MAX_BATCH]
            got = self._locked("GET", read, part, alloc)
            if got is None:
                _drop_all(out)
                return None
            out.extend(got)
        return out

    def _read_locked(
        self, conn: _Connection, deadline: float, keys: Sequence[bytes], alloc: Alloc
    ) -> list[MemoryObj | None]:
        """``keys`` copied out: those whose location this connection knows are copied from it
        and checked (no round trip; reported later by TOUCH), the others (and any whose check
        fails) asked with one READ. Known locations are trusted only while the connection is
        open (one non-blocking peek per call)."""
        where = conn.where
        if not where:
            return self._read_answered(conn, deadline, keys, alloc)
        if not _peer_open(conn):
            # A dead server's pool stays mapped here and its versions never move again: only a
            # live connection's locations are trusted. The caller reconnects (empty ``where``).
            raise ConnectionError("cache server closed the connection")
        assert conn.mapping is not None
        known = [where.get(k) for k in keys]
        out, stale = _copy_checked(conn.mapping, known, alloc)
        try:
            for i in stale:  # the entry left the index since we were told where it lies
                where.pop(keys[i], None)  # (a key may come twice in one batch)
            self._served_known(conn, [keys[i] for i, loc in enumerate(known) if loc is not None and out[i] is not None])
            ask = sorted([i for i, loc in enumerate(known) if loc is None] + stale)
            if ask:
                _splice(out, ask, self._read_answered(conn, deadline, [keys[i] for i in ask], alloc))
            else:
                self._flush_touches(conn, deadline)
        except BaseException:
            _drop_all(out)
            raise
        return out

    def _read_answered(
        self, conn: _Connection, deadline: float, keys: Sequence[bytes], alloc: Alloc
    ) -> list[MemoryObj | None]:
        """One lease-free READ of ``keys``, each hit copied out and checked (and its location
        kept); the keys whose entries left the index during their copy are read again under a
        lease."""
        v = _exchange(conn, Op.READ, encode_keys(keys), deadline, self._pending(conn))
        mapping = conn.mapping
        assert mapping is not None
        hits = _hits(v, len(keys), mapping.pool_bytes, 2, "READ")
        out, stale = _copy_checked(mapping, hits, alloc)
        try:
            for i, hit in enumerate(hits):
                if hit is not None and out[i] is not None:
                    self._remember(conn, keys[i], hit)
            if stale:
                self.rereads += len(stale)
                _splice(out, stale, self._get_keys_locked(conn, deadline, [keys[i] for i in stale], alloc))
        except BaseException:
            _drop_all(out)
            raise
        return out

    def _remember(self, conn: _Connection, key: bytes, hit: Hit) -> None:
        """Keep where a READ said ``key`` lies (oldest dropped past :data:`LOCATIONS_MAX`), when
        locations are remembered."""
        if self.remember_locations:
            where = conn.where
            if len(where) >= LOCATIONS_MAX:
                del where[next(iter(where))]
            where[key] = hit

    def _served_known(self, conn: _Connection, served: list[bytes]) -> None:
        """Count the reads served from remembered locations; the next request reports them
        (TOUCH)."""
        conn.touched.extend(served)
        self.known_reads += len(served)

    def _flush_touches(self, conn: _Connection, deadline: float) -> None:
        """Send the pending TOUCH on its own once :data:`TOUCH_BATCH` reads wait for one."""
        if len(conn.touched) >= TOUCH_BATCH:
            _send_frames(conn, self._pending(conn), deadline)

    def _get_keys_locked(
        self, conn: _Connection, deadline: float, keys: Sequence[bytes], alloc: Alloc
    ) -> list[MemoryObj | None]:
        """One leasing GET of ``keys``, each hit copied out, the leases released."""
        return self._get_locked(conn, deadline, Op.GET, encode_keys(keys), len(keys), alloc)

    def _get_locked(
        self, conn: _Connection, deadline: float, op: Op, body: bytes, n: int, alloc: Alloc
    ) -> list[MemoryObj | None]:
        """One leasing request (GET or GET_HELD), each hit copied out, the leases released."""
        until = time.monotonic() + conn.ttl_s  # the server's lease TTL starts later than this
        return self._copy_out(conn, _exchange(conn, op, body, deadline, self._pending(conn)), n, alloc, until)

    def _copy_out(self, conn: _Connection, v: memoryview, n: int, alloc: Alloc, until: float) -> list[MemoryObj | None]:
        """Copy each hit of a leasing answer ``v`` into a buffer from ``alloc``, then release the
        leases (one unanswered frame); the caller owns the buffers. Copies that ended after the
        leases may have (``until`` passed, or the server closed the connection: a reader stalled
        that long) are given back and answered None (:func:`_leases_held`)."""
        mapping = conn.mapping
        assert mapping is not None
        hits = _hits(v, n, mapping.pool_bytes, 1, "GET")
        try:
            out = _copy_hits(mapping, hits, alloc)
            if not _leases_held(conn, until):
                self.stale_leases += sum(o is not None for o in out)
                _drop_all(out)
                out = [None] * n
            return out
        finally:
            leases = [h[0] for h in hits if h is not None]
            if leases:
                _release(conn, leases)

    # ---- reads into caller memory --------------------------------------------------------------------
    def read_into(self, keys: Sequence[bytes], sinks: Sequence[ReadSink], prefix: bool = False) -> list[bool] | None:
        """Each entry copied straight from the mapped pool into its sink (caller-owned memory
        of the sink's shape and dtype): one flag per key, True when the sink holds the entry's
        committed bytes. False for a miss, an entry of another shape or dtype (counted in
        ``read_mismatches``) or a key longer than :data:`MAX_KEY_BYTES`; that sink's bytes are
        then not to be used. ``prefix``: stop at the first key not filled (nothing later is
        copied). None: the server could not be asked; sinks may be partly written.

        The reads of :meth:`get` with no buffer between the pool and the sink: one READ round
        trip for the keys whose location this connection does not remember, then per key in
        order one ``memmove`` per piece and the version check; a copy whose entry left the
        index meanwhile is copied again under a lease (one GET round trip). Where lease-free
        reads are not safe (:data:`OPTIMISTIC_READS`) the batch is read under leases (one GET
        round trip, the leases released after the copies)."""
        n = len(keys)
        if len(sinks) != n:
            raise ValueError(f"sinks has {len(sinks)} entries for {n} keys")
        if not n:
            return []
        if (fit := self._fitting(keys)) is not None:
            if prefix:  # the prefix ends at the first key that cannot be sent
                m = next(i for i, j in enumerate([*fit, n]) if i != j)
                head = self.read_into(keys[:m], sinks[:m], True) if m else []
                return None if head is None else head + [False] * (n - m)
            got = self.read_into([keys[i] for i in fit], [sinks[i] for i in fit], False)
            return _spread(fit, got, n, False)
        out: list[bool] = []
        for i in range(0, n, MAX_BATCH):
            got = self._locked(
                "READ", self._read_into_locked, keys[i : i + MAX_BATCH], sinks[i : i + MAX_BATCH], prefix
            )
            if got is None:
                return None if not out else out + [False] * (n - len(out))
            out.extend(got)
            if prefix and not all(got):
                break
        return out + [False] * (n - len(out))

    def _read_into_locked(
        self, conn: _Connection, deadline: float, keys: Sequence[bytes], sinks: Sequence[ReadSink], prefix: bool
    ) -> list[bool]:
        n = len(keys)
        if not OPTIMISTIC_READS:
            return self._leased_into(conn, deadline, keys, sinks, prefix)
        where = conn.where
        known = [where.get(k) for k in keys] if where else [None] * n
        if any(loc is not None for loc in known) and not _peer_open(conn):
            raise ConnectionError("cache server closed the connection")  # see _read_locked
        ask = [i for i, loc in enumerate(known) if loc is None]
        hits = list(known)
        if ask:
            v = _exchange(conn, Op.READ, encode_keys([keys[i] for i in ask]), deadline, self._pending(conn))
            assert conn.mapping is not None
            for i, hit in zip(ask, _hits(v, len(ask), conn.mapping.pool_bytes, 2, "READ"), strict=True):
                hits[i] = hit
        mapping = conn.mapping
        assert mapping is not None
        base, versions = mapping.data.data_ptr(), mapping.versions
        out = [False] * n
        served: list[bytes] = []
        for i, hit in enumerate(hits):
            key, sink = keys[i], sinks[i]
            if hit is not None:
                version, off, meta = hit
                if known[i] is not None and not sink.fits(meta.shape, meta.dtype):
                    # a remembered location may be stale: what lies there now decides
                    where.pop(key, None)
                    out[i] = self._leased_into(conn, deadline, [key], [sink], prefix)[0]
                elif not sink.fits(meta.shape, meta.dtype):
                    self.read_mismatches += 1
                else:
                    _copy_into(sink, base + off)
                    if version_sum(versions, off, meta.nbytes) == version:
                        out[i] = True
                        if known[i] is not None:
                            served.append(key)
                        else:
                            self._remember(conn, key, hit)
                    else:  # the entry left the index during the copy: read it under a lease
                        where.pop(key, None)
                        self.rereads += 1
                        out[i] = self._leased_into(conn, deadline, [key], [sink], prefix)[0]
            if prefix and not out[i]:
                break
        self._served_known(conn, served)
        self._flush_touches(conn, deadline)
        return out

    def _leased_into(
        self, conn: _Connection, deadline: float, keys: Sequence[bytes], sinks: Sequence[ReadSink], prefix: bool
    ) -> list[bool]:
        """``keys`` copied into their sinks under leases: one GET round trip for the batch, the
        copies in order (with ``prefix``, none after the first miss or entry of another shape or
        dtype), then every lease released with one unanswered frame."""
        assert conn.mapping is not None
        until = time.monotonic() + conn.ttl_s  # the server's lease TTL starts later than this
        v = _exchange(conn, Op.GET, encode_keys(keys), deadline, self._pending(conn))
        hits = _hits(v, len(keys), conn.mapping.pool_bytes, 1, "GET")
        base = conn.mapping.data.data_ptr()
        out = [False] * len(keys)
        try:
            for i, hit in enumerate(hits):
                if hit is not None:
                    _lease, off, meta = hit
                    if sinks[i].fits(meta.shape, meta.dtype):
                        _copy_into(sinks[i], base + off)
                        out[i] = True
                    else:
                        self.read_mismatches += 1
                if prefix and not out[i]:
                    break
            if any(out) and not _leases_held(conn, until):  # a reader stalled past its leases
                self.stale_leases += sum(out)
                out = [False] * len(keys)
        finally:
            leases = [h[0] for h in hits if h is not None]
            if leases:
                _release(conn, leases)
        return out

    # ---- zero-copy reads -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def get_view(self, key: bytes) -> Iterator[EntryView | None]:
        """``with client.get_view(key) as view:`` a zero-copy :class:`EntryView` of the entry
        under a lease, or None (a miss, or the server could not be asked).

        For callers that do not keep the result (they read, hash or copy it elsewhere inside
        the block); :meth:`get` copies. The lease ends when the block exits, normally or by an
        exception. See :mod:`lmcache_async.server.views` for when a view is refused.
        """
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        view = self._locked("GET", self._lease_one, key)
        if view is None:
            yield None
            return
        try:
            yield view
        finally:
            if not view.valid():
                self.stale_views += 1
            view.close()
            self._end_lease(view)

    def _lease_one(self, conn: _Connection, deadline: float, key: bytes) -> EntryView | None:
        started = time.monotonic()  # the server's lease TTL starts later than this
        return _lease_entry(conn, deadline, key, self._pending(conn), started)

    def _end_lease(self, view: EntryView) -> None:
        """Release a view's lease on its connection (nothing to do when that connection is gone:
        the server reclaimed it; a lock busy past the timeout leaves it to the lease's TTL)."""
        if not self._acquire(time.monotonic() + self.timeout_s):
            return
        try:
            conn = view.connection
            if conn is self._conn and conn.open:
                _release(conn, [view.lease_id])
        finally:
            self._lock.release()

    # ---- holds (a promise to another process) ----------------------------------------------------
    def hold(self, keys: Sequence[bytes], ttl_s: float) -> list[int] | None:
        """Pin each entry for up to ``ttl_s`` seconds, for readers of any process: one token per
        key (0 for a miss or a refused hold), or None when the server could not be asked.

        A held entry stays readable through :meth:`get_held` after its key is removed or
        evicted, until :meth:`unhold` (from any client of the namespace) or the TTL.
        """
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if not keys:
            return []
        if len(keys) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} keys per hold, got {len(keys)}")
        if (fit := self._fitting(keys)) is not None:
            return _spread(fit, self.hold([keys[i] for i in fit], ttl_s), len(keys), 0)
        ttl_ms = min(int(ttl_s * 1000), 0xFFFFFFFF)
        body = Writer().u32(max(ttl_ms, 1)).keys(keys).body()
        return self._call(Op.HOLD, body, functools.partial(_tokens_of, n=len(keys)))

    def unhold(self, tokens: Sequence[int]) -> bool:
        """Drop holds (unknown or expired tokens are ignored); False when it could not be sent."""
        tokens = [t for t in tokens if t]
        if not tokens:
            return True
        w = Writer().u16(len(tokens))
        for t in tokens:
            w.u64(t)
        frame = w.frame(Op.UNHOLD, 0)

        def send(conn: _Connection, deadline: float) -> bool:
            _send_frames(conn, self._pending(conn) + frame, deadline)
            return True

        return self._locked("UNHOLD", send) is True

    def get_held(self, tokens: Sequence[int], alloc: Alloc) -> list[MemoryObj | None] | None:
        """Each held entry copied into a buffer from ``alloc`` (the caller owns it), None per
        token that holds nothing (dropped, expired, or held on a server that restarted since)."""
        if not tokens:
            return []
        if len(tokens) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} tokens per call, got {len(tokens)}")
        w = Writer().u16(len(tokens))
        for t in tokens:
            w.u64(t)
        return self._locked("GET_HELD", self._get_locked, Op.GET_HELD, w.body(), len(tokens), alloc)

    def put(self, items: Sequence[tuple[bytes, MemoryObj]]) -> list[bool] | None:
        """Store each payload (copied into granted blocks, then committed): True when stored or
        already present. A put into a pre-granted block is one round trip; others take two.
        A key longer than :data:`MAX_KEY_BYTES` is not sent (False)."""
        if not items:
            return []
        if (fit := self._fitting([k for k, _ in items])) is not None:
            return _spread(fit, self.put([items[i] for i in fit]), len(items), False)
        metas = [EntryMeta.of(obj.shape, obj.dtype, obj.fmt) for _, obj in items]
        return self._locked("PUT", self._put_locked, items, metas)

    def _put_locked(
        self, conn: _Connection, deadline: float, items: Sequence[tuple[bytes, MemoryObj]], metas: list[EntryMeta]
    ) -> list[bool]:
        """One put under the lock (:func:`~lmcache_async.server.client_writes.store`)."""
        assert conn.mapping is not None
        return _store(conn, deadline, items, metas, self._pending(conn))

    def remove(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Remove each key; True where something was removed."""
        if keys and (fit := self._fitting(keys)) is not None:
            return _spread(fit, self.remove([keys[i] for i in fit]), len(keys), False)
        out: list[bool] = []
        for i in range(0, len(keys), MAX_BATCH):
            part = keys[i : i + MAX_BATCH]
            got = self._call(Op.REMOVE, Writer().keys(part).body(), functools.partial(_flags_of, n=len(part)))
            if got is None:
                return None
            out.extend(got)
        return out

    def clear(self) -> bool:
        """Remove every entry of this namespace from every tier of the server: True when all
        are clear; False when the server could not be asked, or named tiers it could not clear
        completely (kept in :attr:`uncleared` and logged)."""
        got = self._call(Op.CLEAR, b"", lambda c, r: [r.blob().decode("utf-8", "replace") for _ in range(r.u16())])
        if got is None:
            return False
        self.uncleared = got
        if got:
            self._log.warning("cache server %s: CLEAR could not clear tier(s) %s", self.path, got, key="clear")
        return not got

    def list_page(
        self, after: bytes = b"", prefix: bytes = b"", limit: int = 256
    ) -> tuple[list[ListedEntry], bool] | None:
        """One page of this namespace's entries in key order (``LIST``): those whose keys start
        with ``prefix`` and sort after ``after`` (the last key of the previous page), at most
        ``limit``; and whether more follow. None when the server could not be asked. Recency and
        hit counts are not touched. ``ValueError`` for a ``limit`` outside 1..MAX_LIST_PAGE or a
        key argument longer than MAX_KEY_BYTES."""
        if not isinstance(limit, int) or not 0 < limit <= MAX_LIST_PAGE:
            raise ValueError(f"limit must be an int in 1..{MAX_LIST_PAGE}, got {limit!r}")
        for name, v in (("after", after), ("prefix", prefix)):
            if not isinstance(v, bytes) or len(v) > MAX_KEY_BYTES:
                raise ValueError(f"{name} must be bytes of at most {MAX_KEY_BYTES}, got {type(v).__name__}")
        body = Writer().blob(after).blob(prefix).u16(limit).body()
        return self._call(Op.LIST, body, _list_of)

    def entries(self, prefix: bytes = b"", page: int = 256) -> Iterator[ListedEntry]:
        """Every entry whose key starts with ``prefix``, in key order, page by page
        (:meth:`list_page`); ``ConnectionError`` when a page cannot be had. Entries put or
        removed meanwhile may or may not be seen."""
        after = b""
        while True:
            got = self.list_page(after, prefix, page)
            if got is None:
                raise ConnectionError(f"cache server {self.path} did not answer LIST")
            items, more = got
            yield from items
            if not more or not items:
                return
            after = items[-1].key

    def ping(self) -> bool:
        """True when the server answers."""
        return self._call(Op.PING, b"", lambda c, r: True) is True

    def server_stats(self) -> dict[str, Any] | None:
        """The server's figures (as ``lmcache-async status`` prints them), or None."""
        return self._call(Op.STATS, b"", lambda c, r: _json(r))


def query_status(
    path: str, *, token: str | None = None, timeout_s: float = 5.0, server_uid: int | None = None
) -> dict[str, Any]:
    """The figures of the server on ``path`` (a status connection: no namespace, no pool): the
    namespaces this process may join only.

    Raises ``OSError``/``ConnectionError`` when it cannot be reached, refuses us, or runs as
    neither our uid nor ``server_uid``.
    """
    deadline = time.monotonic() + timeout_s
    conn = _connect(path, "", token, Mode.STATUS, deadline, server_uid=server_uid)
    try:
        r = Reader(_exchange(conn, Op.STATS, b"", deadline))
        return _json(r)
    finally:
        conn.sock.close()
