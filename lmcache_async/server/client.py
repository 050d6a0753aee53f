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
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from lmcache_async.circuit import CircuitBreaker
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.read_sinks import ReadSink
from lmcache_async.server.connection import Connection as _Connection
from lmcache_async.server.connection import ServerUnavailable
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.connection import copy_bytes as _copy_bytes
from lmcache_async.server.connection import exchange as _exchange
from lmcache_async.server.connection import peer_open as _peer_open
from lmcache_async.server.connection import send_frames as _send_frames
from lmcache_async.server.protocol import (
    COMMIT_FAILED,
    FRAME,
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
from lmcache_async.server.protocol import decode_meta as _decode_meta
from lmcache_async.server.protocol import encode_meta as _encode_meta
from lmcache_async.server.shm import OPTIMISTIC_READS, PoolMapping, version_sum
from lmcache_async.server.views import EntryView

__all__ = ["EntryView", "ListedEntry", "ServerClient", "ServerUnavailable", "query_status"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Pre-granted blocks kept per block size, and in all (a put into one of them is one round trip).
PREGRANT_PER_SIZE = 2
PREGRANT_TOTAL = 16
#: Entry locations a connection remembers for reads with no round trip (oldest dropped first).
LOCATIONS_MAX = 8192
#: Reads from remembered locations reported in one TOUCH at the latest (else on the next request).
TOUCH_BATCH = 64

_U16 = struct.Struct("<H")
_TOUCH_BODY = 1 << 20  # bytes of keys in one TOUCH frame at most (far below MAX_BODY)


class _ForkWatch:
    """This process's pid, kept current across ``fork`` without a system call per request."""

    pid = os.getpid()

    @classmethod
    def update(cls) -> None:
        cls.pid = os.getpid()


_fork = _ForkWatch
os.register_at_fork(after_in_child=_ForkWatch.update)
_HIT = struct.Struct("<BQQ")  # a hit: flag (1 GET, 2 READ), lease id or version, offset (then the metadata)
#: A decoded hit: (lease id or version, offset, metadata).
Hit = tuple[int, int, EntryMeta]
_RELEASE_HEAD = struct.Struct("<IBIH")  # frame header of a RELEASE and its count
_COMMIT_HEAD = struct.Struct("<QH")  # a COMMIT item: grant id, key length (then key, metadata)

Alloc = Callable[[Sequence[int], torch.dtype, Any], "MemoryObj | None"]


class ServerClient:
    """A thread-safe client of one namespace on a cache server; see the module docstring.

    ``None`` from any call means the server could not be asked (down, timed out, breaker open,
    malformed answer); other answers are the server's. Buffers returned by :meth:`get` come
    from ``alloc`` and are owned by the caller (one reference each). ``remember_locations``
    (default on) lets :meth:`get` copy an entry it read before straight from where it lies,
    with no round trip, while the pool's version table shows it still indexed there.
    """

    def __init__(
        self,
        path: str,
        namespace: str,
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        max_backoff_s: float = 4.0,
        remember_locations: bool = True,
        server_uid: int | None = None,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if server_uid is not None and (not isinstance(server_uid, int) or server_uid < 0):
            raise ValueError(f"server_uid must be a uid (an int >= 0), got {server_uid!r}")
        self.path = path
        self.namespace = namespace
        #: The uid the server may run as besides ours (``SO_PEERCRED``, checked before anything is sent).
        self.server_uid = os.getuid() if server_uid is None else server_uid
        self.token = token
        self.timeout_s = float(timeout_s)
        #: Keep the locations READ answers and copy from them again with no round trip.
        self.remember_locations = bool(remember_locations)
        self.breaker = CircuitBreaker(threshold=1, base_backoff_s=min(0.25, max_backoff_s), max_backoff_s=max_backoff_s)
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._log = RateLimitedLog(logger)
        self.errors = 0
        self.skipped = 0
        self.long_keys = 0
        self.connects = 0
        #: Stale connections replaced within a call (the server had stopped or restarted).
        self.reconnects = 0
        #: Connections that found a pool generation other than the previous connection's.
        self.new_generations = 0
        #: Views whose lease was lost before they were read (see :meth:`get_view`).
        self.stale_views = 0
        #: Lease-free copies whose entry left the index during the copy, read again under a lease.
        self.rereads = 0
        #: Entries copied from a location this client already knew (no round trip).
        self.known_reads = 0
        #: Reads into a sink of another shape or dtype than the entry's (a miss).
        self.read_mismatches = 0
        #: Copies under a lease that ended before the copy did (TTL passed under a stalled reader,
        #: or the server closed the connection): given back, a miss.
        self.stale_leases = 0
        #: Tiers the last ``clear`` could not clear completely (as the server named them).
        self.uncleared: list[str] = []
        self.generation = 0

    # ---- connection management (call with the lock held) -------------------------------------------
    def _ensure(self, deadline: float) -> _Connection | None:
        conn = self._conn
        if conn is not None and conn.pid != _fork.pid:
            # A forked child must not speak on its parent's connection: close our copy of the
            # descriptor (the parent's stays open) and connect afresh.
            conn.close()
            self._conn = conn = None
        elif conn is not None and not conn.open:
            self._conn = conn = None
        if conn is not None:
            return conn
        if self._closed or not self.breaker.allow():
            self.skipped += 1
            return None
        try:
            conn = _connect(
                self.path, self.namespace, self.token, Mode.CLIENT, deadline, self.timeout_s, self.server_uid
            )
        except (OSError, ServerUnavailable, ProtocolError, ValueError) as exc:
            self._fail(f"connect: {exc}")
            return None
        self._conn = conn
        self.connects += 1
        assert conn.mapping is not None
        if self.generation and conn.mapping.generation != self.generation:
            self.new_generations += 1  # a restarted server (or a namespace created afresh)
        self.generation = conn.mapping.generation
        return conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _fail(self, why: str) -> None:
        self.errors += 1
        self.breaker.failure()
        self._drop()
        self._log.warning("cache server %s: %s (answering misses)", self.path, why, key="fail")

    def _acquire(self, deadline: float) -> bool:
        lock = self._lock
        if lock.acquire(False) or lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return True
        self.skipped += 1
        return False

    def _locked(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Run ``fn(connection, deadline, *args)`` under the lock; None (counted, logged) on trouble.

        A connection that served earlier calls and turns out closed by the server (it stopped
        or restarted since) is replaced once within the same deadline: the call reconnects,
        maps the new pool and runs again. Every request is safe to repeat on a new connection
        (the old one's leases and grants died with it).
        """
        deadline = time.monotonic() + self.timeout_s
        if not self._acquire(deadline):
            return None
        try:
            retried = False
            while True:
                reused = self._conn is not None
                conn = self._ensure(deadline)
                if conn is None:
                    return None
                try:
                    out = fn(conn, deadline, *args)
                except ConnectionError as exc:
                    if reused and not retried and time.monotonic() < deadline:
                        retried = True
                        self.reconnects += 1
                        self._drop()
                        continue
                    self._fail(f"{what}: {type(exc).__name__}: {exc}")
                    return None
                except (OSError, ProtocolError, ValueError) as exc:
                    self._fail(f"{what}: {type(exc).__name__}: {exc}")
                    return None
                breaker = self.breaker
                if breaker.failures or breaker.state != breaker.CLOSED:
                    breaker.success()
                return out
        finally:
            self._lock.release()

    def _call(self, op: Op, body: bytes, parse: Callable[[_Connection, Reader], T]) -> T | None:
        def run(conn: _Connection, deadline: float) -> T:
            r = Reader(_exchange(conn, op, body, deadline, self._pending(conn)))
            out = parse(conn, r)
            r.done()
            return out

        return self._locked(op.name, run)

    def _pending(self, conn: _Connection) -> bytes:
        """The unanswered frames that ride on the next request: the reads this connection
        served from known locations (TOUCH), and cached grants close to their server-side
        expiry (UNGRANT); b"" when there are none."""
        touch = b""
        if conn.touched:
            touch = _touch_frames(conn.touched)
            conn.touched = []
        return touch + self._stale_grants(conn)

    def _stale_grants(self, conn: _Connection) -> bytes:
        """An UNGRANT frame for cached grants close to their server-side expiry (or b"")."""
        now = time.monotonic()
        if now < conn.grants_checked_until:
            return b""
        stale: list[int] = []
        soonest = float("inf")
        for size, lst in conn.grants.items():
            keep = [g for g in lst if g[2] > now]
            stale.extend(g[0] for g in lst if g[2] <= now)
            conn.grants[size] = keep
            for g in keep:
                soonest = min(soonest, g[2])
        conn.grants_checked_until = soonest
        if not stale:
            return b""
        w = Writer().u16(len(stale))
        for gid in stale:
            w.u64(gid)
        return w.frame(Op.UNGRANT, 0)

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
        r = Reader(_exchange(conn, Op.GET, encode_keys([key]), deadline, self._pending(conn)))
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
            _release(conn, [lid])
            raise ProtocolError("GET answer points outside the pool")
        return EntryView(conn, lid, off, meta, started + conn.ttl_s)

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
        assert conn.mapping is not None
        pre = self._pending(conn)
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
            r = Reader(_exchange(conn, Op.GRANT, w.body(), deadline, pre))
            pre = b""
            got = _grants(r, len(missing), conn.mapping.pool_bytes)
            r.done()
            for i, g in zip(missing, got, strict=True):
                blocks[i] = None if g is None else (g[0], g[1])
        data = conn.mapping.data
        base = data.data_ptr()
        committed = [i for i, b in enumerate(blocks) if b is not None]
        parts = [_U16.pack(len(committed))]
        for i in committed:
            gid, off = blocks[i]  # type: ignore[misc]
            n = metas[i].nbytes
            if n:
                _copy_bytes(items[i][1].tensor, base + off, data, off, n, out_of_pool=False)
            key = items[i][0]
            parts.append(_COMMIT_HEAD.pack(gid, len(key)))
            parts.append(key)
            parts.append(_encode_meta(metas[i]))
        refill = self._refill_sizes(conn, [sizes[i] for i in committed])
        parts.append(_U16.pack(len(refill)))
        parts.append(struct.pack(f"<{len(refill)}Q", *refill))
        r = Reader(_exchange(conn, Op.COMMIT, b"".join(parts), deadline, pre))
        if r.u16() != len(committed):
            raise ProtocolError("COMMIT answer has the wrong count")
        results = [r.u8() for _ in committed]
        now = time.monotonic()
        for s, g in zip(refill, _grants(r, len(refill), conn.mapping.pool_bytes), strict=True):
            if g is not None:
                expiry = now + conn.ttl_s / 2
                conn.grants.setdefault(s, []).append((g[0], g[1], expiry))
                conn.grants_checked_until = min(conn.grants_checked_until, expiry)
        r.done()
        out = [False] * len(items)
        for i, res in zip(committed, results, strict=True):
            out[i] = res != COMMIT_FAILED
        return out

    def _fitting(self, keys: Sequence[bytes]) -> list[int] | None:
        """None when every key fits the wire's key limit (the common case, one pass); else the
        indices of those that do, after counting and logging the others."""
        if max(map(len, keys)) <= MAX_KEY_BYTES:
            return None
        fit = [i for i, k in enumerate(keys) if len(k) <= MAX_KEY_BYTES]
        self.long_keys += len(keys) - len(fit)
        self._log.warning(
            "%d key(s) longer than %d bytes are not sent to the cache server (a miss)",
            len(keys) - len(fit), MAX_KEY_BYTES, key="long-key",
        )  # fmt: skip
        return fit

    @staticmethod
    def _refill_sizes(conn: _Connection, used: list[int]) -> list[int]:
        want: list[int] = []
        total = conn.cached_grants()
        for s in dict.fromkeys(used):
            have = len(conn.grants.get(s, ()))
            k = min(PREGRANT_PER_SIZE - have, PREGRANT_TOTAL - total)
            if k > 0:
                want.extend([s] * k)
                total += k
        return want

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

    def stats(self) -> dict[str, Any]:
        """This client's counters (no I/O)."""
        return {
            "errors": self.errors,
            "skipped": self.skipped,
            "long_keys": self.long_keys,
            "connects": self.connects,
            "reconnects": self.reconnects,
            "new_generations": self.new_generations,
            "stale_views": self.stale_views,
            "rereads": self.rereads,
            "known_reads": self.known_reads,
            "read_mismatches": self.read_mismatches,
            "stale_leases": self.stale_leases,
            "connected": self._conn is not None,
            "circuit": self.breaker.state,
        }

    def close(self) -> None:
        """Close the connection (the server reclaims its leases and grants). Idempotent."""
        self._closed = True
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _hits(v: memoryview, n: int, pool_bytes: int, flag: int, what: str) -> list[Hit | None]:
    """The ``n`` entries of a GET (``flag`` 1: lease id) or READ (2: version) answer: per key
    None for a miss or (lease id or version, offset, metadata); :class:`ProtocolError` for an
    answer that is malformed or points outside the pool."""
    if len(v) < 2 or _U16.unpack_from(v, 0)[0] != n:
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
        if pos + _HIT.size > end:
            raise ProtocolError("message truncated")
        got, ident, off = _HIT.unpack_from(v, pos)
        if got != flag:
            raise ProtocolError(f"{what} answer has hit flag {got}")
        meta, pos = _decode_meta(v, pos + _HIT.size)
        if off + meta.nbytes > pool_bytes:
            raise ProtocolError(f"{what} answer points outside the pool")
        out.append((ident, off, meta))
    if pos != end:
        raise ProtocolError(f"{end - pos} trailing bytes")
    return out


def _copy_hits(mapping: PoolMapping, hits: Sequence[Hit | None], alloc: Alloc) -> list[MemoryObj | None]:
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
                    _copy_bytes(obj.tensor, base + off, data, off, meta.nbytes, out_of_pool=True)
            out.append(obj)
    except BaseException:
        _drop_all(out)
        raise
    return out


def _copy_checked(
    mapping: PoolMapping, hits: Sequence[Hit | None], alloc: Alloc
) -> tuple[list[MemoryObj | None], list[int]]:
    """Each lease-free hit ``(version, offset, metadata)`` copied out (:func:`_copy_hits`), then
    checked against the mapped version table: a copy whose entry left the index meanwhile is
    given back (None in the result) and its index listed, in order, as stale."""
    out = _copy_hits(mapping, hits, alloc)
    versions = mapping.versions
    stale: list[int] = []
    for i, hit in enumerate(hits):
        obj = out[i]
        if hit is not None and obj is not None and version_sum(versions, hit[1], hit[2].nbytes) != hit[0]:
            obj.ref_count_down()
            out[i] = None
            stale.append(i)
    return out, stale


def _leases_held(conn: _Connection, until: float) -> bool:
    """Whether leases taken on ``conn`` after ``until - ttl`` still held once a copy under them
    ended: the TTL had not passed by our clock (the server starts it later and frees a block at
    its expiry at the earliest) and the server had not closed the connection (the only other way
    it ends a lease). A reader stalled past either, for any length of time, is told so."""
    return time.monotonic() < until and _peer_open(conn)


def _copy_into(sink: ReadSink, src: int) -> None:
    """Copy a payload at address ``src`` of the mapped pool into ``sink``'s pieces, in order."""
    for addr, n in sink.pieces:
        ctypes.memmove(addr, src, n)
        src += n


def _splice(out: list[MemoryObj | None], at: Sequence[int], got: Sequence[MemoryObj | None]) -> None:
    """Put ``got[j]`` at ``out[at[j]]``, giving back the buffer it replaces."""
    for i, obj in zip(at, got, strict=True):
        old, out[i] = out[i], obj
        if old is not None:
            old.ref_count_down()


def _drop_all(objs: Sequence[MemoryObj | None]) -> None:
    """Give back one reference of each buffer (a call that fails keeps none)."""
    for o in objs:
        if o is not None:
            o.ref_count_down()


def _release(conn: _Connection, leases: Sequence[int]) -> None:
    """End leases with one unanswered RELEASE. A send that fails leaves the connection to the
    next call (which finds it closed and reconnects); the server reclaims the leases of a
    connection that goes away, so nothing stays pinned."""
    n = len(leases)
    frame = _RELEASE_HEAD.pack(2 + 8 * n, Op.RELEASE, 0, n) + struct.pack(f"<{n}Q", *leases)
    try:
        conn.sock.sendall(frame)
    except OSError:
        conn.close()  # a frame may be half sent: this connection cannot be used again


def _touch_frames(keys: list[bytes]) -> bytes:
    """Unanswered TOUCH frames for ``keys``, each within the batch and body limits."""
    frames: list[bytes] = []
    start, size = 0, 0
    for i, k in enumerate(keys):
        if i - start == MAX_BATCH or size + 2 + len(k) > _TOUCH_BODY:
            frames.append(encode_keys(keys[start:i]))
            start, size = i, 0
        size += 2 + len(k)
    frames.append(encode_keys(keys[start:]))
    return b"".join(FRAME.pack(len(body), Op.TOUCH, 0) + body for body in frames)


def _flags_of(conn: _Connection, r: Reader, n: int) -> list[bool]:
    return _flags(r, n)


def _tokens_of(conn: _Connection, r: Reader, n: int) -> list[int]:
    if r.u16() != n:
        raise ProtocolError("HOLD answer has the wrong count")
    return [r.u64() for _ in range(n)]


def _flags(r: Reader, n: int) -> list[bool]:
    if r.u16() != n:
        raise ProtocolError("answer has the wrong count")
    return [bool(r.u8()) for _ in range(n)]


def _grants(r: Reader, n: int, pool_bytes: int) -> list[tuple[int, int] | None]:
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


def _list_of(conn: _Connection, r: Reader) -> tuple[list[ListedEntry], bool]:
    out = [ListedEntry(r.blob(), r.meta(), r.u64(), bool(r.u8())) for _ in range(r.u16())]
    return out, bool(r.u8())


def _json(r: Reader) -> dict[str, Any]:
    try:
        out = json.loads(r.rest())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"stats answer is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ProtocolError("stats answer is not an object")
    return out


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


def _spread(fit: list[int], got: list[T] | None, n: int, absent: T) -> list[T] | None:
    """The answers ``got`` for the keys at indices ``fit``, spread over ``n`` places with
    ``absent`` at the others; None stays None."""
    if got is None:
        return None
    out = [absent] * n
    for i, v in zip(fit, got, strict=True):
        out[i] = v
    return out
