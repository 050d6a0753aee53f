"""Mooncake Store tier figures (the ``mooncake`` section of the remote suite).

The store is started by the suite on loopback (:class:`~lmcache_async.testing.servers.MooncakeServers`:
a metadata server, the master and one segment holder); the tier and the baseline are pure
clients (segment size 0), so every byte crosses to the holder and back.

* **1 MiB and 16 MiB put/get**: the tier (:class:`~lmcache_async.remote.mooncake.MooncakeBackend`)
  vs the raw ``MooncakeDistributedStore`` client doing the same work: one executor hop per
  operation on a pool of the same size, the same xxh3 checksum of the payload (computed before
  a put, verified after a get), registered buffers, fresh keys in every put round (made before
  the round is timed, for both sides). Two raw baselines: ``put_from``/``get_into`` (the plain
  calls), and the calls the tier itself makes for one entry (``put_from_with_metadata`` with a
  header-sized buffer; a get session with one ranged read of the whole object), which isolates
  what the tier adds: building the record header, a second ranged read, the allocation of the
  read buffer. Target >= 0.85 against both.
* **beside the Redis tier** (when the remote suite has a Redis server): the same entries
  through the Redis tier in the same rounds (informational).
* **recovery after a master restart**: time from killing the master (restarted at once on the
  same port; the holder mounts again by itself) until the tier serves a fresh entry again.

Rounds alternate tier and baseline; each figure is the median over ``reps`` rounds and the note
gives the median of the per-round ratios. ``opts.extra["concurrency"]`` (default 4).
Run ``python -m lmcache_async_bench.remote_mooncake [--quick]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
import xxhash

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.tiers import BackendContext

from .common import BenchOptions, MiB, Result

__all__ = ["PREFIX", "SUITE", "Op", "available", "run", "section"]

SUITE = "remote"
PREFIX = "benchmc"

Op = Callable[[int], Awaitable[None]]


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench/model", 1, 0, (i * 0x9E3779B97F4A7C15 + 11) & ((1 << 64) - 1), torch.bfloat16)


async def _rate(n: int, conc: int, nbytes: int, op: Op) -> float:
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem:
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


class _Raw:
    """The baseline: one raw ``MooncakeDistributedStore`` pure client with registered source and
    destination memory, its calls on an executor of the tier's size."""

    def __init__(self, srv: Any, workers: int, regions: Sequence[tuple[int, int]], head: MemoryObj) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", srv.metadata_server, 0, 64 << 20, "tcp", "", f"127.0.0.1:{srv.rpc_port}")
        if rc != 0:
            raise RuntimeError(f"raw Mooncake client setup failed: {rc}")
        for addr, size in regions:
            if self.store.register_buffer(addr, size) != 0:
                raise RuntimeError("raw Mooncake client: register_buffer failed")
        self.config = ReplicateConfig()
        self.config.replica_num = 1
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lmcache-async-bench-mc-raw")
        self.head = head  # a registered header-sized buffer (the tier's header room of the bench keys)

    def put(self, key: str, obj: MemoryObj) -> None:
        xxhash.xxh3_64_intdigest(obj.byte_view())  # the tier checksums what it stores
        rc = self.store.put_from(key, obj.data_ptr, obj.nbytes, self.config)
        if rc != 0:
            raise RuntimeError(f"raw put_from failed: {rc}")

    def get(self, key: str, obj: MemoryObj) -> None:
        n = self.store.get_into(key, obj.data_ptr, obj.nbytes)
        if n != obj.nbytes:
            raise RuntimeError(f"raw get_into failed: {n}")
        xxhash.xxh3_64_intdigest(obj.byte_view())  # the tier verifies what it read

    def put_header_call(self, key: str, obj: MemoryObj) -> None:
        """As :meth:`put`, through the call the tier makes for one entry
        (``put_from_with_metadata``: a header-sized buffer, then the payload)."""
        xxhash.xxh3_64_intdigest(obj.byte_view())
        head = self.head
        rc = self.store.put_from_with_metadata(key, obj.data_ptr, head.data_ptr, obj.nbytes, head.nbytes, self.config)
        if rc != 0:
            raise RuntimeError(f"raw put_from_with_metadata failed: {rc}")

    def get_session_call(self, key: str, obj: MemoryObj) -> None:
        """As :meth:`get`, through the calls the tier uses (a get session, one ranged read)."""
        if self.store.batch_get_session_start([key]) != [0]:
            raise RuntimeError("raw batch_get_session_start failed")
        try:
            n = self.store.batch_get_into_multi_buffer_ranges([key], [[obj.data_ptr]], [[obj.nbytes]], [[0]])
        finally:
            self.store.batch_get_session_end([key])
        if n != [obj.nbytes]:
            raise RuntimeError(f"raw ranged get failed: {n}")
        xxhash.xxh3_64_intdigest(obj.byte_view())

    def remove_all(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.store.remove(k, True)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.store.close()


class _Ops:
    """The operations one put/get figure times, on ``count`` source entries: the tier's, the raw
    client's (plain calls, and the calls the tier itself makes) and, with ``redis_be``, the Redis
    tier's. Every put round gets fresh keys (:meth:`new_keys`), made before it is timed."""

    def __init__(
        self, be: Any, raw: _Raw, redis_be: Any, srcs: list[MemoryObj], free_dsts: list[MemoryObj], count: int
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.be, self.raw, self.redis_be = be, raw, redis_be
        self.srcs, self.free_dsts, self.count = srcs, free_dsts, count
        self.gen = 0
        self.tkeys: list[CacheEngineKey] = []
        self.rkeys: list[str] = []
        self.r2keys: list[str] = []

    def new_keys(self) -> None:
        self.gen += 1  # fresh keys: a put of a present key stores nothing
        self.tkeys[:] = [_key(self.gen * 1000 + i) for i in range(self.count)]
        self.rkeys[:] = [f"raw:{self.gen}:{i}" for i in range(self.count)]
        self.r2keys[:] = [f"raw2:{self.gen}:{i}" for i in range(self.count)]

    async def tier_put(self, i: int) -> None:
        assert await self.be.put(self.tkeys[i], self.srcs[i])

    async def tier_get(self, i: int) -> None:
        obj = await self.be.get(self.tkeys[i])
        assert obj is not None, "mooncake tier missed an entry it stored"
        obj.ref_count_down()

    async def raw_put(self, i: int) -> None:
        await self.loop.run_in_executor(self.raw.executor, self.raw.put, self.rkeys[i], self.srcs[i])

    async def _raw_into(self, fn: Callable[[str, MemoryObj], None], key: str) -> None:
        dst = self.free_dsts.pop()
        try:
            await self.loop.run_in_executor(self.raw.executor, fn, key, dst)
        finally:
            self.free_dsts.append(dst)

    async def raw_get(self, i: int) -> None:
        await self._raw_into(self.raw.get, self.rkeys[i])

    async def raw2_put(self, i: int) -> None:
        await self.loop.run_in_executor(self.raw.executor, self.raw.put_header_call, self.r2keys[i], self.srcs[i])

    async def raw2_get(self, i: int) -> None:
        await self._raw_into(self.raw.get_session_call, self.r2keys[i])

    async def redis_put(self, i: int) -> None:
        assert self.redis_be is not None and await self.redis_be.put(self.tkeys[i], self.srcs[i])

    async def redis_get(self, i: int) -> None:
        assert self.redis_be is not None
        obj = await self.redis_be.get(self.tkeys[i])
        assert obj is not None
        obj.ref_count_down()

    async def wipe(self) -> None:
        await self.be.clear()
        await self.loop.run_in_executor(self.raw.executor, self.raw.remove_all, self.rkeys + self.r2keys)
        if self.redis_be is not None:
            await self.redis_be.clear()

    def puts_and_gets(self) -> tuple[list[Op], list[Op]]:
        """The put and the get operations, in the order tier, raw, raw2 (, redis)."""
        puts: list[Op] = [self.tier_put, self.raw_put, self.raw2_put]
        gets: list[Op] = [self.tier_get, self.raw_get, self.raw2_get]
        if self.redis_be is not None:
            puts.append(self.redis_put)
            gets.append(self.redis_get)
        return puts, gets


async def _rounds(ops: _Ops, conc: int, nbytes: int, reps: int) -> dict[str, list[float]]:
    """``reps`` (+ 1 warm-up) put rounds on fresh keys, then as many get rounds of the last put
    round's entries, the order of the sides flipping each round; samples by ``{op}_{side}``."""
    puts, gets = ops.puts_and_gets()
    samples: list[list[float]] = [[] for _ in puts]
    for r in range(reps + 1):
        await ops.wipe()
        ops.new_keys()
        order = list(range(len(puts))) if r % 2 == 0 else list(reversed(range(len(puts))))
        for j in order:
            v = await _rate(ops.count, conc, nbytes, puts[j])
            if r:
                samples[j].append(v)
    get_samples: list[list[float]] = [[] for _ in gets]
    for r in range(reps + 1):  # the last put round's entries are read
        order = list(range(len(gets))) if r % 2 == 0 else list(reversed(range(len(gets))))
        for j in order:
            v = await _rate(ops.count, conc, nbytes, gets[j])
            if r:
                get_samples[j].append(v)
    out: dict[str, list[float]] = {}
    names = ["tier", "raw", "raw2", "redis"]
    for j in range(len(puts)):
        out[f"put_{names[j]}"] = samples[j]
        out[f"get_{names[j]}"] = get_samples[j]
    return out


async def _put_get(
    opts: BenchOptions, srv: Any, rig: dict[str, Any], nbytes: int, count: int, reps: int, redis_url: str | None
) -> dict[str, list[float]]:
    """Samples (GB/s per round) of tier, raw and (optionally) Redis-tier puts and gets."""
    from lmcache_async.remote import RemoteBackend
    from lmcache_async.remote.mooncake import MooncakeBackend

    conc: int = rig["conc"]
    src_pool: PoolAllocator = rig["src"]
    dst_pool: PoolAllocator = rig["dst"]
    g = torch.Generator().manual_seed(nbytes)
    srcs: list[MemoryObj] = []
    for _ in range(count):
        o = src_pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
        assert o is not None, "bench source pool exhausted"
        o.tensor.random_(0, 256, generator=g)
        srcs.append(o)
    dsts = [dst_pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY) for _ in range(conc)]
    assert all(d is not None for d in dsts), "bench destination pool exhausted"
    free_dsts = [d for d in dsts if d is not None]
    be = MooncakeBackend(rig["ctx"](srv.config()), prefix=PREFIX, timeout_s=60.0, workers=rig["workers"])
    await be.start()
    redis_be = None
    if redis_url is not None:
        redis_be = RemoteBackend(rig["ctx"]({"remote_url": redis_url}), prefix=PREFIX, timeout_s=60.0)
        await redis_be.start()
    ops = _Ops(be, rig["raw"], redis_be, srcs, free_dsts, count)
    try:
        out = await _rounds(ops, conc, nbytes, reps)
        st = be.stats()
        if st["corrupt"] or st["foreign"]:
            raise RuntimeError(f"the Mooncake tier read bad records during the benchmark: {st}")
        await ops.wipe()
    finally:
        await be.close()
        if redis_be is not None:
            await redis_be.close()
        for o in srcs:
            o.ref_count_down()
        for d in dsts:
            if d is not None:
                d.ref_count_down()
    return out


async def _recovery(srv: Any, rig: dict[str, Any], timeout_s: float = 1.0) -> tuple[float, float | None]:
    """Seconds from a master restart until the tier serves a fresh entry, and the backend's own
    figure (first failure noticed -> new client set up)."""
    from lmcache_async.remote.mooncake import MooncakeBackend

    be = MooncakeBackend(rig["ctx"](srv.config()), prefix=PREFIX + "rec", timeout_s=timeout_s)
    await be.start()
    src = rig["src"].allocate((MiB,), torch.uint8, MemoryFormat.BINARY)
    assert src is not None
    try:
        assert await be.put(_key(1), src)
        t0 = time.perf_counter()
        srv.restart_master()
        i = 2
        while time.perf_counter() - t0 < 120:
            try:
                if await be.put(_key(i), src):
                    obj = await be.get(_key(i))
                    if obj is not None:
                        obj.ref_count_down()
                        return time.perf_counter() - t0, be.stats()["last_recovery_s"]
            except Exception:  # refused or timed out while the master is away
                pass
            i += 1
            await asyncio.sleep(0.05)
        raise RuntimeError("the Mooncake tier did not recover within 120 s")
    finally:
        await be.close()
        src.ref_count_down()


def _size_figures(label: str, nbytes: int, conc: int, s: dict[str, list[float]]) -> list[Result]:
    """The rows of one entry size from :func:`_put_get`'s samples ``s``: the tier vs the plain
    raw calls, vs the raw calls the tier uses, and (when measured) beside the Redis tier."""
    out: list[Result] = []
    med = statistics.median
    for op in ("put", "get"):
        out.append(
            Result(
                SUITE,
                f"mooncake {label} {op}",
                med(s[f"{op}_tier"]),
                "GB/s",
                f"raw MooncakeDistributedStore {'put_from' if op == 'put' else 'get_into'}",
                med(s[f"{op}_raw"]),
                higher_is_better=True,
                target=0.85,
                target_kind="min",
                note=f"median of paired rounds {_paired(s[f'{op}_tier'], s[f'{op}_raw']):.3f}",
                params={"size": nbytes, "panel": "mooncake tier", "series": op, "in_flight": conc},
            )
        )
        call = "put_from_with_metadata" if op == "put" else "get session + one ranged read"
        out.append(
            Result(
                SUITE,
                f"mooncake {label} {op}, vs the raw calls the tier uses",
                med(s[f"{op}_tier"]),
                "GB/s",
                f"raw MooncakeDistributedStore {call}",
                med(s[f"{op}_raw2"]),
                higher_is_better=True,
                target=0.85,
                target_kind="min",
                note=f"median of paired rounds {_paired(s[f'{op}_tier'], s[f'{op}_raw2']):.3f}",
                params={
                    "size": nbytes,
                    "panel": "mooncake tier vs the raw calls it uses",
                    "series": op,
                    "in_flight": conc,
                },
            )
        )
        if f"{op}_redis" in s:
            out.append(
                Result(
                    SUITE,
                    f"mooncake {label} {op} beside the Redis tier",
                    med(s[f"{op}_tier"]),
                    "GB/s",
                    "Redis tier (same entries, same rounds)",
                    med(s[f"{op}_redis"]),
                    higher_is_better=True,
                    note=f"informational; median of paired rounds {_paired(s[f'{op}_tier'], s[f'{op}_redis']):.3f}",
                    params={
                        "size": nbytes,
                        "panel": "mooncake tier vs the Redis tier",
                        "series": op,
                        "in_flight": conc,
                    },
                )
            )
    return out


async def _run(opts: BenchOptions, redis_url: str | None) -> list[Result]:
    """Start the Mooncake servers and a rig of pools and clients; every Mooncake figure."""
    from lmcache_async.testing.servers import MooncakeServers

    conc = int(opts.extra.get("concurrency", 4))
    reps = max(opts.reps, 5) if opts.quick else 2 * max(opts.reps, 5) + 1
    out: list[Result] = []
    with MooncakeServers(segment_bytes=1024 * MiB, lease_ttl_ms=10_000) as srv:
        opts.say(f"remote/mooncake: started {srv!r}")
        loop = asyncio.get_running_loop()
        executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-bench-mc")
        scale = 2 if opts.quick else 1  # a quick run moves half as many entries
        staging = PoolAllocator(512 * MiB // scale, name="bench-mc-staging")
        src = PoolAllocator(384 * MiB // scale, name="bench-mc-src")
        dst = PoolAllocator(96 * MiB, name="bench-mc-dst")
        for p in (staging, src, dst):
            p.wait_ready(30)
        heap = HeapAllocator("bench-mc-heap")

        def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
            return staging.allocate(shape, dtype, fmt) or heap.allocate(shape, dtype, fmt)

        def ctx(cfg: dict[str, Any]) -> BackendContext:
            # The pool the tier registers is the one puts read from (the manager's CPU pool).
            return BackendContext(
                config=LMCacheEngineConfig.from_defaults(remote_key_prefix=PREFIX, **cfg),
                metadata=LMCacheEngineMetadata("bench/model"),
                cache_name="bench",
                loop=loop,
                executor=executor,
                staging=alloc,
                staging_pool=staging,
                pool=src,
            )

        workers = 4
        from lmcache_async.remote.mooncake import header_room

        head = dst.allocate((header_room(_key(0).to_string()),), torch.uint8, MemoryFormat.BINARY)
        assert head is not None
        raw = _Raw(srv, workers, [(p.base_ptr, p.capacity) for p in (src, dst)], head)
        rig = {"conc": conc, "src": src, "dst": dst, "ctx": ctx, "raw": raw, "workers": workers}
        try:
            for nbytes, count in ((MiB, 16 if opts.quick else 32), (16 * MiB, 4 if opts.quick else 8)):
                label = f"{nbytes // MiB} MiB"
                opts.say(f"remote/mooncake: {label} entries x {count}, concurrency {conc}")
                s = await _put_get(opts, srv, rig, nbytes, count, reps, redis_url)
                out += _size_figures(label, nbytes, conc, s)
            opts.say("remote/mooncake: recovery after a master restart (remote_timeout_s 1.0)")
            total, own = await _recovery(srv, rig)
            out.append(
                Result(
                    SUITE,
                    "mooncake recovery after a master restart",
                    total,
                    "s",
                    note="restart to first fresh entry served again"
                    + (f"; the tier's own down-to-new-client time {own:.2f} s" if own is not None else ""),
                )
            )
        finally:
            raw.close()
            head.ref_count_down()
            executor.shutdown(wait=True)
    return out


def available(opts: BenchOptions) -> bool:
    """True when the Mooncake wheel and its binaries are installed (else a progress line)."""
    from lmcache_async.testing.servers import mooncake_binaries

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        opts.say(f"remote/mooncake skipped: the Mooncake Store client cannot be imported ({exc})")
        return False
    if mooncake_binaries() is None:
        opts.say("remote/mooncake skipped: no mooncake_master/mooncake_client binaries")
        return False
    return True


async def section(opts: BenchOptions, redis_url: str | None = None) -> list[Result]:
    """The Mooncake figures (none, with a progress line, when Mooncake is not installed)."""
    if not available(opts):
        return []
    return await _run(opts, redis_url)


def run(opts: BenchOptions) -> list[Result]:
    """The Mooncake section alone."""
    return asyncio.run(section(opts))


if __name__ == "__main__":
    import sys

    from .common import format_table

    print(format_table(run(BenchOptions(progress=print, quick="--quick" in sys.argv))))
