"""The connection under :class:`~lmcache_async.server.client.ServerClient`: one blocking
connection shared by threads, its lock, reconnects and circuit breaker, and the client's counters.

:class:`ClientSession` runs each request under the connection's lock within the client's
timeout (:meth:`ClientSession._locked`), connects (and maps the namespace pool) on demand,
replaces a connection the server closed once per call, and turns every failure into a counted,
logged ``None``. It also builds the unanswered frames that ride on the next request (TOUCH,
UNGRANT) and screens keys against the wire's key limit. The operations themselves are
:class:`~lmcache_async.server.client.ServerClient`'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache_async.circuit import CircuitBreaker
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.server.client_wire import touch_frames, ungrant_frame
from lmcache_async.server.connection import Connection as _Connection
from lmcache_async.server.connection import ServerUnavailable
from lmcache_async.server.connection import connect as _connect
from lmcache_async.server.connection import exchange as _exchange
from lmcache_async.server.protocol import MAX_KEY_BYTES, Mode, Op, ProtocolError, Reader

__all__ = ["ClientSession"]

T = TypeVar("T")

#: The client's log (one name for all of the client's modules).
logger = logging.getLogger("lmcache_async.server.client")


class _ForkWatch:
    """This process's pid, kept current across ``fork`` without a system call per request."""

    pid = os.getpid()

    @classmethod
    def update(cls) -> None:
        cls.pid = os.getpid()


_fork = _ForkWatch
os.register_at_fork(after_in_child=_ForkWatch.update)


class ClientSession:
    """One namespace's connection to a cache server, shared by threads, and the counters of
    its client; the base of :class:`~lmcache_async.server.client.ServerClient` (see there for
    the arguments). ``_locked`` runs a request under the connection's lock; the helpers under
    "connection management" expect that lock held."""

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
            touch = touch_frames(conn.touched)
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
        return ungrant_frame(stale)

    # ---- keys the wire cannot carry ---------------------------------------------------------------
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

    # ---- this client's figures, and the end --------------------------------------------------------
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
