"""The Mooncake Store tier (``remote_url: mooncake://HOST:PORT``, the master's RPC address).

Entries live in Mooncake's distributed memory: the master places objects into segments that
holders (``mooncake_client`` processes, or clients with ``mooncake_global_segment_size > 0``)
mount; this process is usually a pure client (segment size 0) that moves bytes between its
registered memory and those segments.

Layout: one object per entry, named like the Redis tier's record (``<prefix>:<model>:{<digest>}``,
:mod:`.naming`), holding one record (:mod:`lmcache_async.records`): the header, zero-padded to a
length that depends on the key alone (:func:`header_room`), then the payload. So a reader knows
where the payload starts before it has read a byte, and reads header and payload as two ranges
of one get session: the header into a small registered buffer, then — once the header said the
shape and dtype, and the allocator gave a buffer for them — the payload straight into that
buffer. A put sends header and payload from their own buffers as one object
(``batch_put_from_multi_buffers``). No byte is copied on the way in either direction.

Every read is verified (magic, version, header checksum, key, sizes, payload checksum): a
corrupt object is a miss, counted and removed; an object holding another key is a miss, counted
and kept. Presence comes from ``batch_is_exist``; an error answer there raises (the manager
treats it as "unknown"), it never reads as "absent". Removal is forced: the lease a recent
reader holds on an object does not block it.

Blocking: every Mooncake call blocks, so calls run on this tier's own bounded pool of worker
threads. A call that has not finished after ``remote_timeout_s`` is abandoned: its caller gets
a miss at once while the thread finishes it (a dead master holds a call for seconds, a hung one
for tens of seconds); buffers it uses stay referenced until it returns, so nothing is released
under it. The first timeout (or an "unreachable" status) marks the store down: further calls
are refused without touching a thread until a probe (``is_exist``; ``health_check`` keeps
answering "healthy" after the master died) succeeds, and once as many abandoned calls are still
running as there are threads, calls are refused too. A successful probe sets up a fresh client
(a restarted master has forgotten the old one) and the tier serves again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import xxhash

from lmcache_async.backend import Allocate, BackendContext, StorageBackend
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryObj, PoolAllocator
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import MAX_RANK, RecordError, decode_header, encode_header, header_length

from .mooncake_store import (
    ALREADY_EXISTS,
    INVALID_PARAMS,
    NO_SPACE,
    NOT_FOUND,
    RPC_FAIL,
    MooncakeClient,
    MooncakeError,
    MooncakeUnavailable,
    check,
    mooncake_settings,
)
from .naming import EntryName, check_prefix, entry_name

__all__ = [
    "MooncakeBackend",
    "MooncakeError",
    "MooncakeTimeout",
    "MooncakeUnavailable",
    "create",
    "header_room",
    "mooncake_settings",
    "padded_header",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_KEY = "lmcache-async:probe"
"""The key the recovery probe asks about (it never exists)."""
PROBE_INTERVAL_S = 0.25
"""Least time between two recovery probes while the store is down."""
HEADER_ARENA_BYTES = 4 << 20
_ENTRIES_PER_TIMEOUT = 64  # a batch gets one timeout per this many entries (as the manager does)
_LOG_EVERY_S = 5.0


class MooncakeTimeout(TimeoutError):
    """A Mooncake call did not finish within the tier's timeout (it was abandoned)."""


def header_room(key: str) -> int:
    """Bytes the header of ``key``'s record occupies in its object: the longest header any
    shape can need (rank 32) for this key, so a reader knows it from the key alone."""
    return header_length(len(key.encode("utf-8")), MAX_RANK)


def padded_header(obj: MemoryObj, key: str, checksum: int) -> bytes:
    """``obj``'s record header for ``key``, zero-padded to :func:`header_room` bytes (the header
    length field and header checksum cover the padding, as the record format allows)."""
    hb = bytearray(encode_header(key, tuple(obj.shape), obj.dtype, obj.fmt, checksum))
    room = header_room(key)
    if len(hb) < room:
        hb.extend(bytes(room - len(hb)))
        struct.pack_into("<I", hb, 12, room)
        hb[56:64] = bytes(8)
        struct.pack_into("<Q", hb, 56, xxhash.xxh3_64_intdigest(bytes(hb)))
    return bytes(hb)


class _Generation:
    """One set-up client and the worker-thread calls currently using it."""

    __slots__ = ("client", "retired", "users")

    def __init__(self, client: MooncakeClient) -> None:
        self.client = client
        self.users = 0
        self.retired = False


class _Read:
    """A get in progress: where its header and payload go."""

    __slots__ = ("hdr", "head", "name", "obj")

    def __init__(self, name: EntryName, head: MemoryObj) -> None:
        self.name = name
        self.head = head
        self.hdr: Any = None
        self.obj: MemoryObj | None = None


class MooncakeBackend(StorageBackend):
    """The remote tier over a Mooncake Store; see the module docstring.

    ``url``, ``prefix`` and ``timeout_s`` default to ``remote_url``, ``remote_key_prefix`` and
    ``remote_timeout_s``. Construction validates the settings and does not connect;
    :meth:`start` (or the first call) sets the client up. Thread affinity: coroutines run on the
    manager's loop; Mooncake calls run on the tier's threads (``lmcache-async-<cache>-mooncake``).
    """

    name = "remote"

    def __init__(
        self,
        ctx: BackendContext,
        url: str | None = None,
        *,
        prefix: str | None = None,
        timeout_s: float | None = None,
        workers: int | None = None,
    ) -> None:
        cfg = ctx.config
        url = url if url is not None else cfg.remote_url
        if not url:
            raise ValueError("remote_url is not set")
        timeout = cfg.remote_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"remote_timeout_s must be > 0, got {timeout!r}")
        self._settings = mooncake_settings(ctx, url)
        self._prefix = check_prefix(cfg.remote_key_prefix if prefix is None else prefix)
        self._timeout = float(timeout)
        self._alloc = ctx.staging
        self._workers = workers if workers is not None else max(2, cfg.executor_workers)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix=f"lmcache-async-{ctx.cache_name}-mooncake"
        )
        self._heads = PoolAllocator(
            HEADER_ARENA_BYTES, name=f"{ctx.cache_name} mooncake headers", align=64, pretouch=False, reserve_bytes=0
        )
        self._heap = HeapAllocator(f"{ctx.cache_name}-mooncake-heap")
        # Registered once per client: the pool, the staging area and the header arena.
        self._regions = [
            (p.base_ptr, p.capacity) for p in (ctx.pool, ctx.staging_pool, self._heads) if p is not None and p.capacity
        ]
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._gen: _Generation | None = None
        self._down = True  # until the first client is set up
        self._down_since = time.monotonic()
        self._next_probe = 0.0
        self._probe: tuple[int, float] | None = None  # (token, start) of the running probe
        self._probe_token = 0
        self._abandoned = 0
        self._closed = False
        self._rate_log = RateLimitedLog(logger, _LOG_EVERY_S)
        # counters
        self.corrupt = 0
        self.foreign = 0
        self.alloc_failed = 0
        self.no_space = 0
        self.put_errors = 0
        self.read_errors = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.refused = 0
        self.abandoned_calls = 0
        self.setups = 0
        self.last_recovery_s: float | None = None

    # ---- capabilities ----------------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return True  # entries outlive this process (they live in the holders' segments)

    @property
    def shared(self) -> bool:
        return True

    @property
    def is_remote(self) -> bool:
        return True

    @property
    def prefix(self) -> str:
        """The namespace of this backend's entries."""
        return self._prefix

    def entry_name(self, key: CacheEngineKey) -> EntryName:
        """Where ``key``'s entry lives; its Mooncake key is ``.record``."""
        return entry_name(self._prefix, key)

    # ---- calls on the worker threads ---------------------------------------------------------------
    def _log(self, msg: str, *args: Any) -> None:
        """A warning, at most one every few seconds (any thread)."""
        self._rate_log.warning(msg, *args)

    def _mark_down(self, why: str) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + PROBE_INTERVAL_S
        self._log("mooncake tier: store unreachable (%s); calls are refused until a probe succeeds", why)

    def _enter(self, probe: bool) -> _Generation:
        """The client a job uses (counted as one of its users); a probe recovers first."""
        with self._lock:
            if self._closed:
                raise MooncakeUnavailable("call after close", RPC_FAIL)
            gen = self._gen
            if not probe and (self._down or gen is None):  # queued before the store went down
                raise MooncakeUnavailable("call while the store is down", RPC_FAIL)
            if gen is not None:
                gen.users += 1  # a probe asks through the old client: it must stay open meanwhile
            if not probe:
                assert gen is not None
                return gen
        return self._recover(gen)

    def _recover(self, old: _Generation | None) -> _Generation:
        """Probe the master with ``is_exist`` (through the old client) and set up a new client."""
        if old is not None:
            try:
                old.client.is_exist(PROBE_KEY)  # raises (or blocks, and is abandoned) while the master is down
            finally:
                self._leave(old)
        # A setup stuck on a hung master must not hold every later probe's thread.
        if not self._setup_lock.acquire(timeout=self._timeout):
            raise MooncakeUnavailable("a client setup is still running", RPC_FAIL)
        try:
            with self._lock:
                cur = self._gen
                if cur is not None and cur is not old and not self._down:
                    cur.users += 1
                    return cur  # another probe recovered meanwhile
            client = MooncakeClient.open(self._settings, self._regions)
            retired: MooncakeClient | None = None
            with self._lock:
                if self._closed:
                    retired, gen = client, None
                else:
                    prev = self._gen
                    gen = self._gen = _Generation(client)
                    gen.users += 1
                    self.setups += 1
                    if prev is not None:
                        self.last_recovery_s = time.monotonic() - self._down_since
                        prev.retired = True
                        if prev.users == 0:
                            retired = prev.client
                    self._down = False
            if retired is not None:
                retired.close()
            if gen is None:
                raise MooncakeUnavailable("call after close", RPC_FAIL)
            if old is not None:
                logger.info("mooncake tier: the store answers again; a new client is set up")
            return gen
        finally:
            self._setup_lock.release()

    def _leave(self, gen: _Generation) -> None:
        with self._lock:
            gen.users -= 1
            done = gen.users == 0 and (gen.retired or self._closed)
        if done:
            gen.client.close()

    def _job(self, fn: Callable[..., T], args: tuple[Any, ...], probe: bool) -> T:
        gen = self._enter(probe)
        try:
            return fn(gen.client, *args)
        except MooncakeUnavailable as exc:
            self._mark_down(str(exc))
            raise
        finally:
            self._leave(gen)

    async def _call(
        self,
        fn: Callable[..., T],
        *args: Any,
        n: int = 1,
        orphan: Callable[[T], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn(client, *args)`` on a worker thread within the tier's timeout.

        ``orphan`` receives a result nobody awaits any more; ``after`` runs once the job is
        over however it ended (also when it never ran). Refused at once (raising
        :class:`MooncakeUnavailable`) while the store is down and no probe is due, or while
        as many abandoned calls run as there are threads."""
        probe = 0
        try:
            with self._lock:
                if self._closed:
                    raise MooncakeUnavailable("call after close", RPC_FAIL)
                if self._abandoned >= self._workers:
                    self.refused += 1
                    raise MooncakeUnavailable(f"{self._abandoned} timed-out calls still running", RPC_FAIL)
                if self._down or self._gen is None:
                    now = time.monotonic()
                    # A probe stuck longer than the timeout is abandoned: the next one may go.
                    running = self._probe is not None and now - self._probe[1] < self._timeout
                    if running or now < self._next_probe:
                        self.refused += 1
                        raise MooncakeUnavailable("store unreachable; waiting for the next probe", RPC_FAIL)
                    self._probe_token += 1
                    probe = self._probe_token
                    self._probe = (probe, now)
                    self._next_probe = now + PROBE_INTERVAL_S
            cf = self._executor.submit(self._job, fn, args, bool(probe))
        except BaseException:
            if probe:
                self._probe_done(probe)
            if after is not None:
                after()
            raise
        if probe:
            token = probe
            cf.add_done_callback(lambda _f: self._probe_done(token))
        if after is not None:
            cf.add_done_callback(lambda _f: after())
        timeout = self._timeout * max(1, -(-n // _ENTRIES_PER_TIMEOUT))
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.wrap_future(cf)
        except TimeoutError:
            self._abandon(cf, orphan)
            self._mark_down(f"a call took longer than {timeout}s")
            raise MooncakeTimeout(f"mooncake call did not finish within {timeout}s") from None
        except asyncio.CancelledError:
            self._abandon(cf, orphan)
            if time.monotonic() - started >= 0.9 * timeout:  # the manager's own timeout fired
                self._mark_down(f"a call took longer than {timeout}s")
            raise

    def _probe_done(self, token: int) -> None:
        with self._lock:
            if self._probe is not None and self._probe[0] == token:
                self._probe = None

    def _abandon(self, cf: concurrent.futures.Future[T], orphan: Callable[[T], None] | None) -> None:
        if orphan is not None:
            cf.add_done_callback(lambda f: _give_orphan(f, orphan))
        if cf.done():
            return
        with self._lock:
            self._abandoned += 1
            self.abandoned_calls += 1

        def finished(_f: object) -> None:
            with self._lock:
                self._abandoned -= 1

        cf.add_done_callback(finished)

    # ---- blocking jobs -----------------------------------------------------------------------------
    def _head_block(self, room: int) -> MemoryObj:
        obj = self._heads.allocate((room,), torch.uint8)
        return obj if obj is not None else self._heap.allocate((room,), torch.uint8)

    def _put_job(self, client: MooncakeClient, items: list[tuple[EntryName, MemoryObj]]) -> list[bool]:
        heads: list[MemoryObj] = []
        try:
            keys: list[str] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            buffers: list[tuple[int, int]] = []
            for name, obj in items:
                head = padded_header(obj, name.key, xxhash.xxh3_64_intdigest(obj.byte_view()))
                block = self._head_block(len(head))
                heads.append(block)
                block.byte_view()[:] = head
                p, s = [block.data_ptr], [len(head)]
                if obj.nbytes:
                    p.append(obj.data_ptr)
                    s.append(obj.nbytes)
                keys.append(name.record)
                ptrs.append(p)
                sizes.append(s)
                buffers.extend(zip(p, s, strict=True))
            with client.registered(buffers):
                codes = client.put_parts(keys, ptrs, sizes)
        finally:
            for block in heads:
                block.ref_count_down()
        out: list[bool] = []
        for code, (name, _obj), s in zip(codes, items, sizes, strict=True):
            if code in (0, ALREADY_EXISTS):
                out.append(True)
                if code == 0:
                    self.bytes_written += sum(s)
            elif code == NO_SPACE:
                self.no_space += 1
                self._log("mooncake tier: no segment has room for %s (%d bytes)", name.record, sum(s))
                out.append(False)
            else:
                check("put", code)  # raises for "unreachable"
                self.put_errors += 1
                self._log("mooncake tier: put of %s failed with status %d", name.record, code)
                out.append(False)
        return out

    def _get_job(self, client: MooncakeClient, names: list[EntryName], alloc: Allocate) -> list[MemoryObj | None]:
        keys = [n.record for n in names]
        codes = client.session_start(keys)
        open_keys = [k for k, c in zip(keys, codes, strict=True) if c == 0]
        reads: list[_Read] = []
        try:
            for name, code in zip(names, codes, strict=True):
                if code == 0:
                    reads.append(_Read(name, self._head_block(header_room(name.key))))
                elif code != NOT_FOUND:
                    self._read_failed(name, code)
            if reads:
                self._read_headers(client, reads)
                reads = [r for r in reads if r.hdr is not None]
            for r in reads:
                obj = alloc(r.hdr.shape, r.hdr.dtype, r.hdr.fmt)
                if obj is None or obj.nbytes != r.hdr.payload_len:
                    if obj is not None:
                        obj.ref_count_down()
                    self.alloc_failed += 1
                    r.hdr = None
                    continue
                r.obj = obj
            payload_reads = [r for r in reads if r.obj is not None and r.obj.nbytes]
            if payload_reads:
                self._read_payloads(client, payload_reads)
            found: dict[str, MemoryObj] = {}
            for r in reads:
                if r.obj is not None:
                    found[r.name.record] = r.obj
                    r.obj = None
            return [found.get(k) for k in keys]
        except BaseException:
            for r in reads:
                if r.obj is not None:
                    r.obj.ref_count_down()
            raise
        finally:
            for r in reads:
                r.head.ref_count_down()
            if open_keys:
                client.session_end(open_keys)

    def _read_failed(self, name: EntryName, code: int) -> None:
        check("get", code)  # raises for "unreachable"
        self.read_errors += 1
        self._log("mooncake tier: get of %s failed with status %d", name.record, code)

    def _read_headers(self, client: MooncakeClient, reads: list[_Read]) -> None:
        heads = [(r.head.data_ptr, r.head.nbytes) for r in reads]
        with client.registered(heads):
            got = client.read_ranges(
                [r.name.record for r in reads], [[p] for p, _ in heads], [[n] for _, n in heads], [[0]] * len(reads)
            )
        for r, n in zip(reads, got, strict=True):
            if n == r.head.nbytes:
                try:
                    hdr = decode_header(r.head.byte_view())
                    if hdr.num_parts != 1:
                        raise RecordError("a Mooncake record is never split into parts")
                except RecordError as exc:
                    self._corrupt(client, r.name, str(exc))
                    continue
                if hdr.key != r.name.key:
                    self.foreign += 1
                    self._log("mooncake object %s holds another key; treated as a miss", r.name.record)
                    continue
                r.hdr = hdr
            elif n == INVALID_PARAMS and 0 <= client.size(r.name.record) < r.head.nbytes:
                self._corrupt(client, r.name, "object is shorter than its header")
            elif n != NOT_FOUND:
                self._read_failed(r.name, n)

    def _read_payloads(self, client: MooncakeClient, reads: list[_Read]) -> None:
        objs = [r.obj for r in reads]
        assert all(o is not None for o in objs)
        bufs = [(o.data_ptr, o.nbytes) for o in objs if o is not None]
        with client.registered(bufs):
            got = client.read_ranges(
                [r.name.record for r in reads],
                [[p] for p, _ in bufs],
                [[n] for _, n in bufs],
                [[r.hdr.header_len] for r in reads],
            )
        for r, n in zip(reads, got, strict=True):
            obj = r.obj
            assert obj is not None
            why = None
            if n == obj.nbytes:
                if xxhash.xxh3_64_intdigest(obj.byte_view()) == r.hdr.checksum:
                    self.bytes_read += r.hdr.header_len + n
                    continue
                why = "payload checksum mismatch"
            elif n == INVALID_PARAMS and 0 <= client.size(r.name.record) < r.hdr.header_len + obj.nbytes:
                why = "object is shorter than its header says"
            r.obj = None
            obj.ref_count_down()
            if why is not None:
                self._corrupt(client, r.name, why)
            elif n != NOT_FOUND:
                self._read_failed(r.name, n)

    def _corrupt(self, client: MooncakeClient, name: EntryName, why: str) -> None:
        self.corrupt += 1
        self._log("mooncake object %s is corrupt (%s); removed", name.record, why)
        client.remove(name.record)

    def _remove_job(self, client: MooncakeClient, name: EntryName) -> bool:
        code = client.session_start([name.record])[0]
        if code == NOT_FOUND:
            return False
        check("remove", code)
        room = header_room(name.key)
        head = self._head_block(room)
        try:
            with client.registered([(head.data_ptr, room)]):
                n = client.read_ranges([name.record], [[head.data_ptr]], [[room]], [[0]])[0]
            if n == room:
                try:
                    if decode_header(head.byte_view()).key != name.key:
                        return False  # another key's entry (a digest collision): not ours to delete
                except RecordError:
                    pass  # damaged: remove it
            else:
                try:
                    check("remove", n)  # the store unreachable: raised
                except MooncakeUnavailable:
                    raise
                except MooncakeError:
                    pass  # an unreadable header (a damaged object): remove it
        finally:
            head.ref_count_down()
            client.session_end([name.record])
        code = client.remove(name.record)
        if code == NOT_FOUND:
            return False
        check("remove", code)
        return True

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Set the client up and register the pool, staging and header memory. An unreachable
        master raises (the manager logs and counts it); later calls set up by themselves."""
        await self._call(_nothing)

    async def close(self) -> None:
        """Refuse new calls and close the client; a client still used by an abandoned call is
        closed by that call when it ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            gen = self._gen
            idle = gen is not None and gen.users == 0
        self._executor.shutdown(wait=False, cancel_futures=True)
        if gen is not None and idle:
            await asyncio.get_running_loop().run_in_executor(None, gen.client.close)

    # ---- core ----------------------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return (await self.batched_put([(key, obj)]))[0]

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """All items in one Mooncake batch (one job); each block is referenced until it ends."""
        if not items:
            return []
        named = [(entry_name(self._prefix, k), o) for k, o in items]
        taken: list[MemoryObj] = []
        for _, o in named:
            o.ref_count_up()  # the job reads the block; it must outlive a caller that gave up
            taken.append(o)

        def release() -> None:
            for o in taken:
                o.ref_count_down()

        return await self._call(self._put_job, named, n=len(named), after=release)

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return (await self.batched_get([key], alloc))[0]

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        """One result per key, read in one job (one session, two batched transfers)."""
        if not keys:
            return []
        names = [entry_name(self._prefix, k) for k in keys]
        return await self._call(self._get_job, names, alloc or self._alloc, n=len(names), orphan=_release_all)

    async def contains(self, key: CacheEngineKey) -> bool:
        return (await self.batched_contains([key]))[0]

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """``batch_is_exist`` in one job; an error answer raises (unknown, never absent)."""
        if not keys:
            return []
        records = [entry_name(self._prefix, k).record for k in keys]
        flags = await self._call(MooncakeClient.batch_is_exist, records, n=len(records))
        return [f == 1 for f in flags]

    async def remove(self, key: CacheEngineKey) -> bool:
        return await self._call(self._remove_job, entry_name(self._prefix, key))

    async def clear(self) -> None:
        """Remove every object below this backend's prefix (all models)."""
        pattern = "^" + "".join(c if c.isalnum() or c in "_:" else f"[{c}]" for c in self._prefix) + ":"
        await self._call(MooncakeClient.remove_matching, pattern)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            down, abandoned = self._down, self._abandoned
        return {
            "scheme": "mooncake",
            "prefix": self._prefix,
            "corrupt": self.corrupt,
            "foreign": self.foreign,
            "alloc_failed": self.alloc_failed,
            "no_space": self.no_space,
            "put_errors": self.put_errors,
            "read_errors": self.read_errors,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "refused": self.refused,
            "abandoned_calls": self.abandoned_calls,
            "in_flight_abandoned": abandoned,
            "setups": self.setups,
            "store_down": down,
            "last_recovery_s": self.last_recovery_s,
        }


def _nothing(_client: MooncakeClient) -> None:
    return None


def _release_all(objs: list[MemoryObj | None]) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


def _give_orphan(f: concurrent.futures.Future[T], orphan: Callable[[T], None]) -> None:
    if f.cancelled() or f.exception() is not None:
        return
    try:
        orphan(f.result())
    except Exception:  # pragma: no cover - a release that fails must not kill the worker
        logger.debug("releasing an abandoned mooncake result failed", exc_info=True)


def create(ctx: BackendContext) -> MooncakeBackend:
    """Registry factory of the ``mooncake://`` remote tier."""
    return MooncakeBackend(ctx)

