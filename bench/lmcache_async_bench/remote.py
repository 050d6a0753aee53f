"""Remote-tier figures against the SPEC §6 redis baseline, measured in the same run on the same
server: raw ``redis.asyncio`` SET/GET of the same bytes at the same concurrency.

* **1 MiB entries**: tier ``put``/``get`` throughput vs raw SET/GET; target >= 0.85 (the gap
  pays for the record header, the xxh3 checksum and the copy into the read buffer);
* **16 MiB entries**: the tier (payload in parts, one pipeline) vs raw single-key SET/GET;
  targets put >= 2x, get >= 1.5x at the suite's concurrency (one at a time is shown too);
* **batched contains of 256 keys**: round trips (target 1), and its latency beside one raw
  ``EXISTS`` round trip;
* **part-size sweep** on 16 MiB entries (512 KiB ... 4 MiB), which is how the
  ``remote_part_size`` default was chosen;
* **Mooncake Store tier** (when the Mooncake wheel is installed): 1 MiB and 16 MiB put/get vs the
  raw Mooncake client, beside the Redis tier, and recovery after a master restart
  (:mod:`lmcache_async_bench.remote_mooncake`).

Puts go to fresh keys: every key is deleted before each put round, since the tier's put of a
present key is a no-op (deleted, not flushed: see :meth:`_Rig.wipe`). Reads land in a
pre-touched staging pool and are released at once; raw GETs return ``bytes`` that are dropped.
Rounds alternate tier and baseline so background noise hits both; each figure is the median of
``reps`` rounds, and the note gives the median of the per-round ratios.

Without ``opts.redis_url`` the suite starts its own ``redis-server`` (or Valkey) on a free
loopback port. ``opts.extra``: ``concurrency`` (default 4), ``part_sizes`` (sweep list),
``part_size`` (the tier's part size, default: the config default).
Run ``python -m lmcache_async_bench.remote [--quick]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.tiers import BackendContext

from .common import BenchOptions, MiB, Result, with_redis

__all__ = ["PREFIX", "SUITE", "Op", "run"]

SUITE = "remote"
PREFIX = "bench"


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench/model", 1, 0, (i * 0x9E3779B97F4A7C15 + 7) & ((1 << 64) - 1), torch.bfloat16)


class _Rig:
    """A server, a raw client, source blocks and a staging pool, all on one loop."""

    def __init__(self, opts: BenchOptions, url: str) -> None:
        import redis.asyncio as aredis

        self.opts = opts
        self.url = url
        self.conc = int(opts.extra.get("concurrency", 4))
        self.raw = aredis.Redis.from_url(url, max_connections=max(8, self.conc * 2))
        self.loop = asyncio.get_running_loop()
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-bench-remote")
        self.staging = PoolAllocator(512 * MiB, name="bench-staging")
        self.heap = HeapAllocator("bench-heap")
        self.src_pool = PoolAllocator(384 * MiB, name="bench-src")
        self.staging.wait_ready(30)
        self.src_pool.wait_ready(30)

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.staging.allocate(shape, dtype, fmt) or self.heap.allocate(shape, dtype, fmt)

    def ctx(self, **cfg: Any) -> BackendContext:
        return BackendContext(
            config=LMCacheEngineConfig.from_defaults(remote_url=self.url, remote_key_prefix=PREFIX, **cfg),
            metadata=LMCacheEngineMetadata("bench/model"),
            cache_name="bench",
            loop=self.loop,
            executor=self.executor,
            staging=self.alloc,
            staging_pool=self.staging,
            pool=None,
        )

    def sources(self, nbytes: int, count: int) -> list[MemoryObj]:
        out = []
        g = torch.Generator().manual_seed(nbytes)
        for _ in range(count):
            obj = self.src_pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
            assert obj is not None, "bench source pool exhausted"
            obj.tensor.random_(0, 256, generator=g)
            out.append(obj)
        return out

    async def wipe(self) -> None:
        """Delete every key, as a cache in steady state frees old entries: the server keeps the
        memory for reuse. (``FLUSHDB`` would also return it to the OS — Redis purges jemalloc
        after a flush — so the next round would pay page faults no running cache pays.)"""
        batch: list[bytes] = []
        async for k in self.raw.scan_iter(count=1000):
            batch.append(k)
            if len(batch) >= 512:
                await self.raw.delete(*batch)
                batch.clear()
        if batch:
            await self.raw.delete(*batch)

    async def close(self) -> None:
        await self.raw.aclose()
        self.executor.shutdown(wait=True)


async def _rate(n: int, conc: int, nbytes: int, op: Callable[[int], Awaitable[Any]]) -> float:
    """GB/s of ``n`` calls of ``op`` with ``conc`` in flight."""
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem:
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n * nbytes / (time.perf_counter() - t0) / 1e9


async def _alternate(reps: int, fns: Sequence[Callable[[], Awaitable[float]]]) -> list[list[float]]:
    """Samples of each of ``fns`` over ``reps`` interleaved rounds (A B, B A, ...), after one
    unrecorded warm-up round."""
    for fn in fns:
        await fn()
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            samples[i].append(await fns[i]())
    return samples


def _bind(
    run: Callable[[Callable[[int], Awaitable[None]]], Awaitable[float]], op: Callable[[int], Awaitable[None]]
) -> Callable[[], Awaitable[float]]:
    return lambda: run(op)


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of a/b (each ratio from measurements taken back to back)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


Op = Callable[[int], Awaitable[None]]
"""One operation on entry ``i``."""


def _tier_ops(be: Any, srcs: Sequence[MemoryObj]) -> tuple[Op, Op]:
    """put and get of entry ``i`` through the tier ``be`` (a miss raises)."""

    async def put(i: int) -> None:
        assert await be.put(_key(i), srcs[i])

    async def get(i: int) -> None:
        obj = await be.get(_key(i))
        assert obj is not None
        obj.ref_count_down()

    return put, get


def _raw_ops(rig: _Rig, views: Sequence[memoryview]) -> tuple[Op, Op]:
    """Raw single-key SET and GET of entry ``i``'s bytes (a miss raises)."""

    async def raw_set(i: int) -> None:
        await rig.raw.set(f"raw:{i}", views[i])

    async def raw_get(i: int) -> None:
        assert await rig.raw.get(f"raw:{i}") is not None

    return raw_set, raw_get


def _rates(
    rig: _Rig, count: int, conc: int, nbytes: int
) -> tuple[Callable[[Op], Awaitable[float]], Callable[[Op], Awaitable[float]]]:
    """``rate(op)``: GB/s of ``op`` over the ``count`` entries; ``fresh(op)``: the same after
    deleting every key (puts into an empty server)."""

    async def rate(op: Op) -> float:
        return await _rate(count, conc, nbytes, op)

    async def fresh(op: Op) -> float:
        await rig.wipe()
        return await rate(op)

    return rate, fresh


async def _put_get(
    rig: _Rig, nbytes: int, count: int, part_size: int, reps: int, conc: int | None = None
) -> dict[str, float]:
    """Tier and raw put/get GB/s for ``count`` entries of ``nbytes``."""
    from lmcache_async.remote import RemoteBackend

    srcs = rig.sources(nbytes, count)
    views = [o.byte_view() for o in srcs]
    be = RemoteBackend(rig.ctx(), part_size=part_size, timeout_s=60.0)
    await be.start()
    conc = rig.conc if conc is None else conc

    tier_put, tier_get = _tier_ops(be, srcs)
    raw_set, raw_get = _raw_ops(rig, views)
    rate, fresh = _rates(rig, count, conc, nbytes)

    try:
        put, sset = await _alternate(reps, [lambda: fresh(tier_put), lambda: fresh(raw_set)])
        await rig.wipe()
        await rate(tier_put)
        await rate(raw_set)
        get, sget = await _alternate(reps, [lambda: rate(tier_get), lambda: rate(raw_get)])
        med = statistics.median
        res = {"put": med(put), "set": med(sset), "get": med(get), "rawget": med(sget)}
        res["put_paired"] = _paired(put, sset)
        res["get_paired"] = _paired(get, sget)
        stats = be.stats()
        if stats["corrupt"] or stats["vanished"]:
            raise RuntimeError(f"the tier read bad records during the benchmark: {stats}")
    finally:
        await be.close()
        await rig.wipe()
        for o in srcs:
            o.ref_count_down()
    return res


async def _sweep(rig: _Rig, nbytes: int, count: int, part_sizes: list[int], reps: int) -> list[Result]:
    """Put/get throughput of the tier for each part size and of raw single-key SET/GET, every
    variant measured in every round (so all see the same background)."""
    from lmcache_async.remote import RemoteBackend

    srcs = rig.sources(nbytes, count)
    views = [o.byte_view() for o in srcs]
    bes = [RemoteBackend(rig.ctx(), prefix=f"{PREFIX}{ps}", part_size=ps, timeout_s=60.0) for ps in part_sizes]
    for be in bes:
        await be.start()

    raw_set, raw_get = _raw_ops(rig, views)
    rate, fresh = _rates(rig, count, rig.conc, nbytes)

    out: list[Result] = []
    try:
        puts = [_tier_ops(be, srcs)[0] for be in bes] + [raw_set]
        put_samples = await _alternate(reps, [_bind(fresh, op) for op in puts])
        await rig.wipe()
        for op in puts:
            await rate(op)
        gets = [_tier_ops(be, srcs)[1] for be in bes] + [raw_get]
        get_samples = await _alternate(reps, [_bind(rate, op) for op in gets])
    finally:
        for be in bes:
            await be.close()
        await rig.wipe()
        for o in srcs:
            o.ref_count_down()
    med = statistics.median
    for kind, samples, base_name in (
        ("put", put_samples, "raw single-key SET"),
        ("get", get_samples, "raw single-key GET"),
    ):
        base = samples[-1]
        for ps, s in zip(part_sizes, samples[:-1], strict=True):
            out.append(
                Result(
                    SUITE,
                    f"sweep {ps >> 10} KiB parts: 16 MiB {kind}",
                    med(s),
                    "GB/s",
                    base_name,
                    med(base),
                    higher_is_better=True,
                    note=f"median of paired rounds {_paired(s, base):.3f}",
                    params={"entry_size": nbytes, "part_size": ps, "in_flight": rig.conc},  # not plotted
                )
            )
    return out


async def _contains(rig: _Rig, reps: int) -> list[Result]:
    from lmcache_async.remote import RemoteBackend

    be = RemoteBackend(rig.ctx())
    await be.start()
    keys = [_key(10_000 + i) for i in range(256)]
    src = rig.sources(4096, 1)[0]
    try:
        for k in keys[::2]:
            await be.put(k, src)
        before = be.stats()["round_trips"]
        flags = await be.batched_contains(keys)
        trips = be.stats()["round_trips"] - before
        assert flags == [i % 2 == 0 for i in range(256)]

        async def tier() -> float:
            t0 = time.perf_counter()
            for _ in range(20):
                await be.batched_contains(keys)
            return (time.perf_counter() - t0) / 20

        async def one_rtt() -> float:
            t0 = time.perf_counter()
            for _ in range(20):
                await rig.raw.exists("raw:probe")
            return (time.perf_counter() - t0) / 20

        s_tier, s_rtt = await _alternate(reps, [tier, one_rtt])
        t_tier, t_rtt = statistics.median(s_tier), statistics.median(s_rtt)
    finally:
        await be.close()
        src.ref_count_down()
        await rig.wipe()
    return [
        Result(SUITE, "batched contains, 256 keys: round trips", float(trips), "trips", target=1, target_kind="max"),
        Result(
            SUITE,
            "batched contains, 256 keys: latency",
            t_tier * 1e6,
            "µs",
            "one raw EXISTS round trip",
            t_rtt * 1e6,
            note="informational: 256 EXISTS in one pipeline vs a single-key round trip",
        ),
    ]


def _pair(
    name: str, nbytes: int, r: dict[str, float], op: str, base_name: str, target: float | None, **params: Any
) -> Result:
    tier, base = (r["put"], r["set"]) if op == "put" else (r["get"], r["rawget"])
    return Result(
        SUITE,
        name,
        tier,
        "GB/s",
        base_name,
        base,
        higher_is_better=True,
        target=target,
        target_kind="min",
        note=f"median of paired rounds {r[op + '_paired']:.3f}",
        params={"size": nbytes, "panel": "remote tier", **params},
    )


async def _big_entry_figures(opts: BenchOptions, rig: _Rig, default_part: int, reps: int) -> list[Result]:
    """16 MiB put and get in parts of ``default_part`` vs single-key SET/GET, at the rig's
    concurrency and (informational) one at a time."""
    out: list[Result] = []
    n16 = 4 if opts.quick else 8
    opts.say(f"remote: 16 MiB entries x {n16}, parts of {default_part >> 10} KiB vs single-key SET/GET")
    r = await _put_get(rig, 16 * MiB, n16, default_part, reps)
    out.append(
        _pair(
            "16 MiB put",
            16 * MiB,
            r,
            "put",
            "raw single-key SET",
            2.0,
            series="put",
            part_size=default_part,
            in_flight=rig.conc,
        )
    )
    out.append(
        _pair(
            "16 MiB get",
            16 * MiB,
            r,
            "get",
            "raw single-key GET",
            1.5,
            series="get",
            part_size=default_part,
            in_flight=rig.conc,
        )
    )
    if rig.conc != 1:
        opts.say("remote: 16 MiB entries, one at a time")
        r = await _put_get(rig, 16 * MiB, n16, default_part, reps, conc=1)
        kw: dict[str, Any] = {"part_size": default_part, "in_flight": 1}
        # Informational: with one request in flight the client and the server take turns,
        # which shrinks what pipelining the parts can win.
        out.append(
            _pair(
                "16 MiB put, concurrency 1",
                16 * MiB,
                r,
                "put",
                "raw single-key SET",
                None,
                series="put, 1 in flight",
                **kw,
            )
        )
        out.append(
            _pair(
                "16 MiB get, concurrency 1",
                16 * MiB,
                r,
                "get",
                "raw single-key GET",
                None,
                series="get, 1 in flight",
                **kw,
            )
        )
    return out


async def _run(opts: BenchOptions, url: str) -> list[Result]:
    """Every remote-tier figure on the Redis server at ``url``, then the Mooncake section."""
    rig = _Rig(opts, url)
    reps = max(opts.reps, 5) if opts.quick else 2 * max(opts.reps, 5) + 1
    default_part = int(opts.extra.get("part_size", LMCacheEngineConfig().remote_part_size))
    out: list[Result] = []
    try:
        n1 = 16 if opts.quick else 32
        opts.say(f"remote: 1 MiB entries x {n1}, concurrency {rig.conc}, part size {default_part >> 10} KiB")
        r = await _put_get(rig, MiB, n1, default_part, reps)
        out.append(_pair("1 MiB put", MiB, r, "put", "raw SET", 0.85, series="put", in_flight=rig.conc))
        out.append(_pair("1 MiB get", MiB, r, "get", "raw GET", 0.85, series="get", in_flight=rig.conc))

        out += await _big_entry_figures(opts, rig, default_part, reps)

        opts.say("remote: batched contains of 256 keys")
        out += await _contains(rig, reps)

        sweep = [int(x) for x in opts.extra.get("part_sizes", [512 << 10, 1 << 20, 2 << 20, 4 << 20])]
        if not opts.quick and sweep:
            opts.say(f"remote: part-size sweep, 16 MiB entries, parts of {[p >> 10 for p in sweep]} KiB")
            out += await _sweep(rig, 16 * MiB, 8, sweep, reps)

        from .remote_mooncake import section as mooncake_section

        out += await mooncake_section(opts, url)  # the Mooncake Store tier, beside this Redis server
    finally:
        await rig.close()
    return out


def run(opts: BenchOptions) -> list[Result]:
    """Every remote-tier figure (see the module docstring)."""
    return with_redis(opts, "remote", lambda url: asyncio.run(_run(opts, url)))


if __name__ == "__main__":
    import sys

    from .common import format_table

    quick = "--quick" in sys.argv
    print(format_table(run(BenchOptions(progress=print, quick=quick))))
