"""Redis / Valkey connector (``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``, ``unix://``).

The client is ``redis.asyncio`` (its connections, handshake, TLS and hiredis parser). Commands
are framed here so a payload goes from the pool block to the socket without an intermediate
``bytes`` copy (the record header and the payload are two buffers of one ``SET`` value).

Wire layout per entry (see :mod:`.naming` and :mod:`.codec`):

* payload <= part size: ``SET <record> <header||payload> NX [PX ttl]`` — one round trip;
  a read is one ``GET``.
* larger payloads: ``MULTI; SET <part i> ...; SET <record> <header||token> NX; EXEC`` — the
  record appears together with its parts or not at all, and a put of a key already present
  leaves the first entry untouched (its own orphaned parts are unlinked, unless the record
  found is the very one this put wrote: see below). A read is ``GET <record>`` then one pipeline of ``GET``s
  for the parts, copied into the read buffer as they arrive and checked against the payload
  checksum.

Connections: a small pool per server, ``max_connections`` (URL option, default 8). A
connection is dropped — never reused — after any error or cancellation in the middle of a
command, so a half-read reply can never reach the next caller; a pooled connection whose peer
went away is noticed before use and reconnected, and one that fails before its first reply is
retried once on a new connection. Every command here may run twice that way: a connection can
drop after the server executed the request but before its reply arrived. They are all
idempotent except in what they answer, and the one answer acted on is handled: a retried
multi-part put whose first try was executed finds its own record (``SET NX`` says nil) and
keeps the parts, which the lost-race cleanup removes only when the record is not ours (one
atomic script). Errors reaching the
server raise (the manager counts them and opens its circuit breaker); the next call after the
server is back reconnects. Every exchange is bounded by ``remote_timeout_s`` (socket timeouts).

Throughput: a command goes out with one scatter-gather ``writev`` straight from the pool block
where the socket takes it (see :func:`_send`), instead of being joined into a new ``bytes``
that asyncio's transport then trims from the front after every ``send``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import (
    PROBE_LEN,
    ForeignSeal,
    RecordError,
    RecordHeader,
    decode_header,
    peek_header_len,
)
from lmcache_async.tiers import Allocate

try:
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError, ResponseError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"the Redis connector needs the 'redis' package ({exc})") from exc

from .codec import (
    MANIFEST_LEN,
    AllocationFailed,
    ForeignRecord,
    allocate,
    copy_single,
    parse_head,
    prepare,
)
from .connector import Connector, ConnectorSettings
from .naming import EntryName
from .redis_internals import stream_transport
from .redis_pool import ConnectionPool, Redirect, check_reply, connection_factory
from .redis_wire import Arg, pack, send
from .url import RemoteURL, parse_remote_url, redact

logger = logging.getLogger(__name__)

__all__ = ["ConnectionPool", "Redirect", "RedisConnector", "connection_factory", "create"]

DEFAULT_MAX_CONNECTIONS = 8
_LOG_EVERY_S = 5.0
_check = check_reply  # (the name :mod:`.cluster` imports)


# Delete a multi-part entry only if its record still is the one we read (a newer write of the
# same key must survive). KEYS = record, then its parts.
_CAS_DELETE = b"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('UNLINK', unpack(KEYS)) end return 0"
# A put that lost the race for its key unlinks its own parts, unless the record is the one this
# put wrote (a retried MULTI/EXEC whose first try was executed: the record names these parts).
# KEYS = record, then our parts; ARGV[1] = our record value. -1 = the record is ours.
_UNLINK_UNLESS_OURS = (
    b"if redis.call('GET', KEYS[1]) == ARGV[1] then return -1 end return redis.call('UNLINK', unpack(KEYS, 2))"
)


class RedisConnector(Connector):
    """Records in one Redis/Valkey server; see the module docstring.

    Subclasses route by key (:meth:`_route`) to serve a Redis Cluster.
    """

    def __init__(self, url: RemoteURL, settings: ConnectorSettings) -> None:
        if settings.part_size <= 0:
            raise ValueError(f"remote_part_size must be > 0, got {settings.part_size}")
        self._url = url
        self._settings = settings
        self._part_size = settings.part_size
        self._cipher = settings.cipher
        self._key_id = settings.cipher.key_id if settings.cipher is not None else None
        self._ttl: tuple[bytes, ...] = ()
        if settings.ttl_s is not None:
            self._ttl = (b"PX", b"%d" % max(1, round(settings.ttl_s * 1000)))
        self._max_conn = url.option_int("max_connections", DEFAULT_MAX_CONNECTIONS)
        self._pools: dict[str, ConnectionPool] = {}
        self._closed = False
        self.round_trips = 0
        self.corrupt = 0
        self.foreign = 0
        self.foreign_key = 0
        self.vanished = 0
        self.alloc_failed = 0
        self.lost_races = 0
        self.replayed_puts = 0
        self.retries = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self._rate_log = RateLimitedLog(logger, _LOG_EVERY_S)

    # ---- routing (the cluster connector overrides these) -------------------------------------
    def _pool(self, address: str, factory: Callable[[], AbstractConnection]) -> ConnectionPool:
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = ConnectionPool(factory, self._max_conn, address)
        return pool

    async def _route(self, key: bytes) -> ConnectionPool:
        """The pool of the server that holds ``key``."""
        if self._closed:
            raise RedisConnectionError("the remote connector is closed")
        url = self._url
        address = url.path if url.kind == "unix" else f"{url.hosts[0][0]}:{url.hosts[0][1]}"
        return self._pool(str(address), connection_factory(url, self._settings))

    async def _primaries(self) -> list[ConnectionPool]:
        """Pools of every server holding a share of the keys."""
        return [await self._route(b"")]

    async def _redirected(self, redirect: Redirect) -> None:
        """React to a MOVED/ASK reply (a single server never sends one)."""
        raise redirect

    # ---- round trips ------------------------------------------------------------------------
    async def _exchange(
        self,
        pool: ConnectionPool,
        chunks: list[bytes | memoryview],
        count: int,
        on_reply: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """Send ``chunks`` (``count`` commands) and read every reply, on one connection.

        Error replies are returned, not raised. Any other failure (network, timeout,
        cancellation) closes the connection before it goes back to the pool; a reused
        connection that turns out dead before any reply is retried once on a new one.
        """
        for attempt in (0, 1):
            conn, fresh = await pool.acquire()
            # Kept aside: redis-py forgets its writer when it closes a connection itself, and
            # a closing transport would go on sending buffered slices of the caller's block.
            transport = stream_transport(conn)
            healthy = False
            read = 0
            try:
                self.round_trips += 1
                await send(conn, chunks, self._settings.timeout_s)
                replies: list[Any] = []
                for i in range(count):
                    try:
                        reply = await conn.read_response(disable_decoding=True)
                    except ResponseError as exc:
                        reply = exc
                    read += 1
                    if on_reply is None:
                        replies.append(reply)
                    else:
                        on_reply(i, reply)
                healthy = True
                return replies
            except (RedisConnectionError, ConnectionError) as exc:
                # A pooled connection whose server restarted fails on first use before the
                # loop has noticed the EOF: one retry on a new connection, as long as no reply
                # was consumed yet. The server may have executed the first try all the same
                # (the reply was lost): see the module docstring for why that is safe.
                if fresh or read or attempt or isinstance(exc, TimeoutError):
                    raise
                self.retries += 1
            finally:
                if not healthy and transport is not None:
                    transport.abort()
                pool.release(conn, healthy)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(
        self,
        key: bytes,
        cmds: Sequence[Sequence[Arg]],
        on_reply: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """Run ``cmds`` in one round trip on the server of ``key``, following redirects."""
        chunks = pack(cmds)
        for _attempt in range(3):
            pool = await self._route(key)
            replies = await self._exchange(pool, chunks, len(cmds), on_reply)
            try:
                for r in replies:
                    _check(r)
            except Redirect as redirect:
                await self._redirected(redirect)
                continue
            return replies
        raise RedisError(f"key {key[:80]!r} kept being redirected")

    def _log(self, msg: str, *args: Any) -> None:
        """A warning, at most one every few seconds (any thread)."""
        self._rate_log.warning(msg, *args)

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Check that the server answers (a failure is raised; later calls reconnect)."""
        for pool in await self._primaries():
            _check((await self._exchange(pool, pack([[b"PING"]]), 1))[0])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            await pool.close()

    # ---- operations -------------------------------------------------------------------------
    @property
    def seals(self) -> bool:
        return True

    async def put(self, name: EntryName, obj: MemoryObj) -> bool:
        out = prepare(name, obj, self._part_size, self._cipher)
        rec = name.record.encode()
        if not out.parts:
            await self._call(rec, [[b"SET", rec, (out.head, out.payload), b"NX", *self._ttl]])
            self.bytes_written += len(out.head) + out.payload.nbytes
            return True
        (present,) = await self._call(rec, [[b"EXISTS", rec]])
        if present:
            return True
        assert out.token is not None
        names = [name.part(out.token, i).encode() for i in range(len(out.parts))]
        cmds: list[list[Arg]] = [[b"MULTI"]]
        cmds += [[b"SET", n, p, *self._ttl] for n, p in zip(names, out.parts, strict=True)]
        cmds += [[b"SET", rec, out.head, b"NX", *self._ttl], [b"EXEC"]]
        replies = await self._call(rec, cmds)
        result = replies[-1]
        if not isinstance(result, list) or len(result) != len(out.parts) + 1:
            raise RedisError(f"unexpected EXEC reply {result!r:.80}")
        for r in result:
            _check(r)
        self.bytes_written += len(out.head) + out.payload.nbytes
        if result[-1] is None:
            # Another writer published this key first: ours are orphans; theirs stay. Or our
            # own first try was executed and only its reply was lost (a retried exchange):
            # then the record is ours and names these very parts, which must stay.
            (n,) = await self._call(
                rec, [[b"EVAL", _UNLINK_UNLESS_OURS, b"%d" % (1 + len(names)), rec, *names, out.head]]
            )
            if int(n) < 0:
                self.replayed_puts += 1
            else:
                self.lost_races += 1
        return True

    async def get(self, name: EntryName, alloc: Allocate) -> MemoryObj | None:
        rec = name.record.encode()
        (value,) = await self._call(rec, [[b"GET", rec]])
        if value is None:
            return None
        try:
            hdr, token = parse_head(value, name, self._key_id)
            if token is None:
                obj = copy_single(value, hdr, alloc, self._cipher)
                self.bytes_read += len(value)
                return obj
        except ForeignSeal as exc:
            self.foreign_key += 1
            self._log("remote record %s is not for this tier's key (%s); treated as a miss", name.record, exc)
            return None
        except ForeignRecord:
            self.foreign += 1
            self._log("remote record %s holds another key; treated as a miss", name.record)
            return None
        except RecordError as exc:
            await self._discard_corrupt(name, rec, value, str(exc))
            return None
        except AllocationFailed:
            self.alloc_failed += 1
            return None
        return await self._get_parts(name, rec, value, hdr, token, alloc)

    async def _get_parts(
        self, name: EntryName, rec: bytes, head: bytes, hdr: RecordHeader, token: str, alloc: Allocate
    ) -> MemoryObj | None:
        plen, psize = hdr.payload_len, hdr.part_size
        try:
            obj = allocate(hdr, alloc)
        except AllocationFailed:
            self.alloc_failed += 1
            return None
        names = [name.part(token, i).encode() for i in range(hdr.num_parts)]
        hasher = xxhash.xxh3_64()
        seal, cipher = hdr.seal, self._cipher
        if seal is not None and (cipher is None or seal.segments != hdr.num_parts):
            obj.ref_count_down()
            await self._discard_corrupt(name, rec, head, "sealed parts do not match the segments", names)
            return None
        problem: list[str] = []
        error: list[Exception] = []

        def on_reply(i: int, reply: Any) -> None:
            if problem or error:
                return
            if isinstance(reply, Exception):
                error.append(reply)
                return
            want = min(psize, plen - i * psize)
            if reply is None:
                problem.append("missing")
            elif len(reply) != want:
                problem.append("size")
            elif seal is not None:  # one sealed segment per part, opened alone
                assert cipher is not None
                hasher.update(reply)
                s, e = seal.plain_bounds(i, hdr.plain_len)
                try:
                    cipher.open_segment(hdr, i, memoryview(reply), dst[s:e])
                except RecordError:
                    problem.append("tag")
            else:
                dst[i * psize : i * psize + want] = reply
                hasher.update(reply)

        try:
            dst = obj.byte_view()
            await self._call(rec, [[b"GET", n] for n in names], on_reply)
            if error:
                _check(error[0])
        except BaseException:
            obj.ref_count_down()
            raise
        if problem or hasher.intdigest() != hdr.checksum:
            obj.ref_count_down()
            why = "a part is missing" if problem == ["missing"] else "parts do not match the record"
            if problem == ["missing"]:
                self.vanished += 1
                self._log("remote record %s: %s; removing it", name.record, why)
                await self._cas_delete(rec, head, names)
            else:
                await self._discard_corrupt(name, rec, head, why, names)
            return None
        self.bytes_read += len(head) + plen
        return obj

    async def _cas_delete(self, rec: bytes, head: bytes, parts: Sequence[bytes]) -> int:
        (n,) = await self._call(rec, [[b"EVAL", _CAS_DELETE, b"%d" % (1 + len(parts)), rec, *parts, head]])
        return int(n)

    async def _discard_corrupt(
        self, name: EntryName, rec: bytes, value: bytes, why: str, parts: Sequence[bytes] = ()
    ) -> None:
        self.corrupt += 1
        self._log("remote record %s is corrupt (%s); removing it", name.record, why)
        await self._cas_delete(rec, value, parts)

    async def exists(self, names: Sequence[EntryName]) -> list[bool]:
        if not names:
            return []
        keys = [n.record.encode() for n in names]
        groups = await self._group(keys)
        flags = [False] * len(keys)

        async def one(idx: list[int]) -> None:
            replies = await self._call(keys[idx[0]], [[b"EXISTS", keys[i]] for i in idx])
            for i, r in zip(idx, replies, strict=True):
                flags[i] = bool(r)

        if len(groups) == 1:
            await one(groups[0])
        else:
            results = await asyncio.gather(*(one(g) for g in groups), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        return flags

    async def _group(self, keys: list[bytes]) -> list[list[int]]:
        """Indices of ``keys`` grouped by the server that holds them."""
        return [list(range(len(keys)))]

    async def remove(self, name: EntryName) -> bool:
        rec = name.record.encode()
        (head,) = await self._call(rec, [[b"GETRANGE", rec, b"0", b"%d" % (PROBE_LEN - 1)]])
        if not head:
            return False
        try:
            hlen = peek_header_len(head)
            if hlen + MANIFEST_LEN > len(head):
                (head,) = await self._call(rec, [[b"GETRANGE", rec, b"0", b"%d" % (hlen + MANIFEST_LEN - 1)]])
            hdr = decode_header(head)
        except RecordError:
            (n,) = await self._call(rec, [[b"UNLINK", rec]])
            return bool(n)
        if hdr.key != name.key:
            return False
        if hdr.num_parts == 1:
            (n,) = await self._call(rec, [[b"UNLINK", rec]])
            return bool(n)
        head = head[: hdr.header_len + MANIFEST_LEN]
        token = head[hdr.header_len :].decode("ascii", "replace")
        parts = [name.part(token, i).encode() for i in range(hdr.num_parts)]
        return await self._cas_delete(rec, head, parts) > 0

    async def clear(self, prefix: str) -> None:
        pattern = prefix.encode() + b":*"
        for pool in await self._primaries():
            cursor = b"0"
            while True:
                (reply,) = await self._exchange(
                    pool, pack([[b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000"]]), 1
                )
                cursor, keys = _check(reply)
                if keys:
                    # One UNLINK per key: in a cluster the keys of one batch span slots.
                    for r in await self._exchange(pool, pack([[b"UNLINK", k] for k in keys]), len(keys)):
                        _check(r)
                if cursor in (b"0", 0):
                    break

    def stats(self) -> dict[str, Any]:
        pools = list(self._pools.values())
        return {
            "url": redact(self._url.scheme + "://" + ",".join(f"{h}:{p}" for h, p in self._url.hosts))
            if self._url.hosts
            else f"{self._url.scheme}://{self._url.path}",
            "part_size": self._part_size,
            "round_trips": self.round_trips,
            "corrupt": self.corrupt,
            "foreign": self.foreign,
            "foreign_key": self.foreign_key,
            "vanished": self.vanished,
            "alloc_failed": self.alloc_failed,
            "lost_races": self.lost_races,
            "replayed_puts": self.replayed_puts,
            "retries": self.retries,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "connects": sum(p.connects for p in pools),
            "connections_dropped": sum(p.dropped for p in pools),
        }


def create(url: str, settings: ConnectorSettings) -> RedisConnector:
    """Registry factory for ``redis``, ``rediss``, ``valkey``, ``valkeys`` and ``unix`` URLs."""
    parsed = parse_remote_url(url)
    if parsed.kind not in ("redis", "unix"):
        raise ValueError(f"remote_url {redact(url)!r} is not a single-server Redis URL")
    return RedisConnector(parsed, settings)
