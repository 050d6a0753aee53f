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
server can never point into a pool mapped from its predecessor.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_async.circuit import CircuitBreaker
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.server.protocol import (
    COMMIT_FAILED,
    FRAME,
    HELLO,
    MAGIC,
    MAX_BATCH,
    MAX_BODY,
    VERSION,
    WELCOME,
    EntryMeta,
    Mode,
    Op,
    ProtocolError,
    Reader,
    Status,
    Writer,
)
from lmcache_async.server.shm import PoolMapping

__all__ = ["ServerClient", "ServerUnavailable", "query_status"]

logger = logging.getLogger(__name__)

#: Pre-granted blocks kept per block size, and in all (a put into one of them is one round trip).
PREGRANT_PER_SIZE = 2
PREGRANT_TOTAL = 16

Alloc = Callable[[Sequence[int], torch.dtype, Any], "MemoryObj | None"]


class ServerUnavailable(ConnectionError):
    """The server could not be reached or admitted us (internal; never leaves this module's callers)."""


class _Connection:
    """One admitted connection and its pool mapping (used under the client's lock)."""

    def __init__(self, sock: socket.socket, mapping: PoolMapping | None, align: int, ttl_s: float) -> None:
        self.sock = sock
        self.mapping = mapping
        self.align = max(align, 1)
        self.ttl_s = ttl_s
        self.seq = itertools.count(1)
        self.pid = os.getpid()
        self.grants: dict[int, list[tuple[int, int, float]]] = {}  # block size -> [(gid, offset, expiry)]
        self.rbuf = bytearray(64 << 10)

    def block_size(self, nbytes: int) -> int:
        a = self.align
        return max(1, -(-nbytes // a)) * a

    def cached_grants(self) -> int:
        return sum(len(v) for v in self.grants.values())


def _connect(path: str, namespace: str, token: str | None, mode: Mode, deadline: float) -> _Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect(path)
        ns = namespace.encode("utf-8")
        tok = (token or "").encode("utf-8")
        sock.sendall(HELLO.pack(MAGIC, VERSION, int(mode), len(ns), len(tok)) + ns + tok)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        msg, fds, _flags, _addr = socket.recv_fds(sock, WELCOME.size, 1)
        try:
            if len(msg) != WELCOME.size:
                raise ServerUnavailable("short handshake answer")
            magic, version, status, gen, pool_bytes, data_off, align, _ml, _mg, ttl_ms = WELCOME.unpack(msg)
            if magic != MAGIC or version != VERSION:
                raise ServerUnavailable("not a cache server of this version")
            if status != Status.OK:
                names = {int(v): v.name for v in Status}
                raise ServerUnavailable(f"admission refused: {names.get(status, status)}")
            mapping = None
            if mode == Mode.CLIENT:
                if len(fds) != 1:
                    raise ServerUnavailable("no pool descriptor in the handshake")
                fd = fds.pop()
                try:
                    mapping = PoolMapping(fd, gen, pool_bytes, data_off)
                except ValueError as exc:
                    raise ServerUnavailable(str(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)
        return _Connection(sock, mapping, align, ttl_ms / 1000.0)
    except BaseException:
        sock.close()
        raise


def _recv_into(conn: _Connection, buf: memoryview, deadline: float) -> None:
    sock = conn.sock
    got = 0
    n = len(buf)
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("cache server did not answer in time")
        sock.settimeout(remaining)
        k = sock.recv_into(buf[got:])
        if k == 0:
            raise ConnectionError("cache server closed the connection")
        got += k


def _exchange(conn: _Connection, op: Op, body: bytes, deadline: float, pre: bytes = b"") -> memoryview:
    """Send one request (after the unanswered frames in ``pre``) and read its answer's body."""
    seq = next(conn.seq) & 0xFFFFFFFF
    conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
    conn.sock.sendall(pre + FRAME.pack(len(body), int(op), seq) + body)
    head = bytearray(FRAME.size)
    _recv_into(conn, memoryview(head), deadline)
    length, rop, rseq = FRAME.unpack(head)
    if rop != op or rseq != seq or length > MAX_BODY:
        raise ProtocolError("answer does not match the request")
    if length > len(conn.rbuf):
        conn.rbuf = bytearray(length)
    view = memoryview(conn.rbuf)[:length]
    _recv_into(conn, view, deadline)
    return view


class ServerClient:
    """A thread-safe client of one namespace on a cache server; see the module docstring.

    ``None`` from any call means the server could not be asked (down, timed out, breaker open,
    malformed answer); other answers are the server's. Buffers returned by :meth:`get` come
    from ``alloc`` and are owned by the caller (one reference each).
    """

    def __init__(
        self,
        path: str,
        namespace: str,
        *,
        token: str | None = None,
        timeout_s: float = 2.0,
        max_backoff_s: float = 4.0,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty str, got {path!r}")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.path = path
        self.namespace = namespace
        self.token = token
        self.timeout_s = float(timeout_s)
        self.breaker = CircuitBreaker(threshold=1, base_backoff_s=min(0.25, max_backoff_s), max_backoff_s=max_backoff_s)
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._closed = False
        self._log = RateLimitedLog(logger)
        self.errors = 0
        self.skipped = 0
        self.connects = 0
        self.generation = 0

    # ---- connection management (call with the lock held) -------------------------------------------
    def _ensure(self, deadline: float) -> _Connection | None:
        conn = self._conn
        if conn is not None and conn.pid != os.getpid():
            # A forked child must not speak on its parent's connection: close our copy of the
            # descriptor (the parent's stays open) and connect afresh.
            try:
                conn.sock.close()
            except OSError:
                pass
            self._conn = conn = None
        if conn is not None:
            return conn
        if self._closed or not self.breaker.allow():
            self.skipped += 1
            return None
        try:
            conn = _connect(self.path, self.namespace, self.token, Mode.CLIENT, deadline)
        except (OSError, ServerUnavailable, ProtocolError, ValueError) as exc:
            self._fail(f"connect: {exc}")
            return None
        self._conn = conn
        self.connects += 1
        assert conn.mapping is not None
        self.generation = conn.mapping.generation
        return conn

    def _fail(self, why: str) -> None:
        self.errors += 1
        self.breaker.failure()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.sock.close()
            except OSError:
                pass
        self._log.warning("cache server %s: %s (answering misses)", self.path, why, key="fail")

    def _acquire(self, deadline: float) -> bool:
        if self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return True
        self.skipped += 1
        return False

    def _call(self, op: Op, body: bytes, parse: Callable[[_Connection, Reader], Any]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        if not self._acquire(deadline):
            return None
        try:
            conn = self._ensure(deadline)
            if conn is None:
                return None
            try:
                answer = _exchange(conn, op, body, deadline, self._stale_grants(conn))
                r = Reader(answer)
                out = parse(conn, r)
                r.done()
            except (OSError, ProtocolError, ValueError) as exc:
                self._fail(f"{op.name}: {type(exc).__name__}: {exc}")
                return None
            self.breaker.success()
            return out
        finally:
            self._lock.release()

    def _stale_grants(self, conn: _Connection) -> bytes:
        """An UNGRANT frame for cached grants close to their server-side expiry (or b"")."""
        now = time.monotonic()
        stale: list[int] = []
        for size, lst in conn.grants.items():
            keep = [g for g in lst if g[2] > now]
            stale.extend(g[0] for g in lst if g[2] <= now)
            conn.grants[size] = keep
        if not stale:
            return b""
        w = Writer().u16(len(stale))
        for gid in stale:
            w.u64(gid)
        return w.frame(Op.UNGRANT, 0)

    # ---- operations --------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes], touch: bool = False) -> list[bool] | None:
        """Presence of each key (one round trip for the batch)."""
        if not keys:
            return []
        out: list[bool] = []
        for i in range(0, len(keys), MAX_BATCH):
            part = keys[i : i + MAX_BATCH]
            body = Writer().u8(int(touch)).keys(part).body()
            got = self._call(Op.CONTAINS, body, functools.partial(_flags_of, n=len(part)))
            if got is None:
                return None
            out.extend(got)
        return out

    def get(self, keys: Sequence[bytes], alloc: Alloc) -> list[MemoryObj | None] | None:
        """Each entry copied into a buffer from ``alloc`` (the caller owns it), None per miss.

        One round trip leases the batch; the copies run on this thread from the mapped pool;
        one unanswered RELEASE ends the leases. A buffer ``alloc`` cannot provide is a miss.
        """
        if not keys:
            return []
        out: list[MemoryObj | None] = []
        for i in range(0, len(keys), MAX_BATCH):
            part = keys[i : i + MAX_BATCH]
            got = self._call(
                Op.GET, Writer().keys(part).body(), functools.partial(self._copy_out, n=len(part), alloc=alloc)
            )
            if got is None:
                for o in out:
                    if o is not None:
                        o.ref_count_down()
                return None
            out.extend(got)
        return out

    def _copy_out(self, conn: _Connection, r: Reader, n: int, alloc: Alloc) -> list[MemoryObj | None]:
        if r.u16() != n:
            raise ProtocolError("GET answer has the wrong count")
        assert conn.mapping is not None
        data = conn.mapping.data
        base = data.data_ptr()
        pool_bytes = conn.mapping.pool_bytes
        out: list[MemoryObj | None] = []
        leases: list[int] = []
        try:
            for _ in range(n):
                if not r.u8():
                    out.append(None)
                    continue
                lid, off = r.u64(), r.u64()
                meta = r.meta()
                leases.append(lid)
                if off + meta.nbytes > pool_bytes:
                    raise ProtocolError("GET answer points outside the pool")
                obj = alloc(meta.shape, meta.dtype, meta.fmt)
                if obj is not None and meta.nbytes:
                    _copy_bytes(obj.tensor, base + off, data[off : off + meta.nbytes], out_of_pool=True)
                out.append(obj)
        except BaseException:
            for o in out:
                if o is not None:
                    o.ref_count_down()
            raise
        finally:
            if leases:
                w = Writer().u16(len(leases))
                for lid in leases:
                    w.u64(lid)
                conn.sock.sendall(w.frame(Op.RELEASE, 0))
        return out

    def put(self, items: Sequence[tuple[bytes, MemoryObj]]) -> list[bool] | None:
        """Store each payload (copied into granted blocks, then committed): True when stored or
        already present. A put into a pre-granted block is one round trip; others take two."""
        if not items:
            return []
        metas = [EntryMeta.of(obj.shape, obj.dtype, obj.fmt) for _, obj in items]
        deadline = time.monotonic() + self.timeout_s
        if not self._acquire(deadline):
            return None
        try:
            conn = self._ensure(deadline)
            if conn is None:
                return None
            try:
                out = self._put_locked(conn, items, metas, deadline)
            except (OSError, ProtocolError, ValueError) as exc:
                self._fail(f"PUT: {type(exc).__name__}: {exc}")
                return None
            self.breaker.success()
            return out
        finally:
            self._lock.release()

    def _put_locked(
        self, conn: _Connection, items: Sequence[tuple[bytes, MemoryObj]], metas: list[EntryMeta], deadline: float
    ) -> list[bool]:
        assert conn.mapping is not None
        pre = self._stale_grants(conn)
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
        w = Writer()
        committed = [i for i, b in enumerate(blocks) if b is not None]
        w.u16(len(committed))
        for i in committed:
            gid, off = blocks[i]  # type: ignore[misc]
            n = metas[i].nbytes
            if n:
                _copy_bytes(items[i][1].tensor, base + off, data[off : off + n], out_of_pool=False)
            w.u64(gid).blob(items[i][0]).meta(metas[i])
        refill = self._refill_sizes(conn, [sizes[i] for i in committed])
        w.u16(len(refill))
        for s in refill:
            w.u64(s)
        r = Reader(_exchange(conn, Op.COMMIT, w.body(), deadline, pre))
        if r.u16() != len(committed):
            raise ProtocolError("COMMIT answer has the wrong count")
        results = [r.u8() for _ in committed]
        now = time.monotonic()
        for s, g in zip(refill, _grants(r, len(refill), conn.mapping.pool_bytes), strict=True):
            if g is not None:
                conn.grants.setdefault(s, []).append((g[0], g[1], now + conn.ttl_s / 2))
        r.done()
        out = [False] * len(items)
        for i, res in zip(committed, results, strict=True):
            out[i] = res != COMMIT_FAILED
        return out

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
        out: list[bool] = []
        for i in range(0, len(keys), MAX_BATCH):
            part = keys[i : i + MAX_BATCH]
            got = self._call(Op.REMOVE, Writer().keys(part).body(), functools.partial(_flags_of, n=len(part)))
            if got is None:
                return None
            out.extend(got)
        return out

    def clear(self) -> bool:
        """Remove every entry of this namespace; False when the server could not be asked."""
        return self._call(Op.CLEAR, b"", lambda c, r: True) is True

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
            "connects": self.connects,
            "connected": self._conn is not None,
            "circuit": self.breaker.state,
        }

    def close(self) -> None:
        """Close the connection (the server reclaims its leases and grants). Idempotent."""
        self._closed = True
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.sock.close()
            except OSError:
                pass


def _copy_bytes(t: torch.Tensor, addr: int, pool_view: torch.Tensor, *, out_of_pool: bool) -> None:
    """Copy between a tensor's bytes and the pool at ``addr`` (``pool_view`` is those bytes).

    A single-threaded ``memmove`` for contiguous CPU tensors: torch's parallel ``copy_`` waits on
    its worker threads, which costs milliseconds when the cores are busy.
    """
    n = pool_view.numel()
    if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() == n:
        if out_of_pool:
            ctypes.memmove(t.data_ptr(), addr, n)
        else:
            ctypes.memmove(addr, t.data_ptr(), n)
        return
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    if out_of_pool:
        t.copy_(pool_view.view(t.dtype).view(t.shape))
    else:
        pool_view.copy_(flat)


def _flags_of(conn: _Connection, r: Reader, n: int) -> list[bool]:
    return _flags(r, n)


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


def _json(r: Reader) -> dict[str, Any]:
    try:
        out = json.loads(r.rest())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"stats answer is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise ProtocolError("stats answer is not an object")
    return out


def query_status(path: str, *, token: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The figures of the server on ``path`` (a status connection: no namespace, no pool).

    Raises ``OSError``/``ConnectionError`` when it cannot be reached or refuses us.
    """
    deadline = time.monotonic() + timeout_s
    conn = _connect(path, "", token, Mode.STATUS, deadline)
    try:
        r = Reader(_exchange(conn, Op.STATS, b"", deadline))
        return _json(r)
    finally:
        conn.sock.close()
