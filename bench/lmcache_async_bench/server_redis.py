"""The node cache server suite's comparison with the Redis tier (see :mod:`lmcache_async_bench.server`):
1 MiB put and get through the node server vs the same through ``RemoteBackend`` on a loopback
``redis-server``, rounds alternating; throughput ratios, target >= 3.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.tiers import Allocate

from .common import BenchOptions, MiB, Result
from .server import SUITE, _kb, _key

__all__ = ["redis_figures"]


async def _redis_round(be: Any, src: MemoryObj, ids: Iterator[int], count: int, op: str) -> float:
    """Median seconds of one ``op`` ("put" or "get") of 1 MiB through the Redis tier ``be``,
    over ``count`` fresh keys (stored first for a get; removed after)."""
    keys = [_key(next(ids)) for _ in range(count)]
    if op == "get":
        for k in keys:
            await be.put(k, src)
    times = []
    for k in keys:
        t0 = time.perf_counter()
        if op == "put":
            await be.put(k, src)
        else:
            got = await be.get(k)
            assert got is not None
            got.ref_count_down()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    for k in keys:
        await be.remove(k)
    return dt


def _server_round(
    client: ServerClient, src: MemoryObj, alloc: Allocate, ids: Iterator[int], count: int, op: str
) -> float:
    """As :func:`_redis_round`, through the node server's ``client``."""
    keys = [_kb(next(ids)) for _ in range(count)]
    if op == "get":
        assert client.put([(k, src) for k in keys]) == [True] * count
    times = []
    for k in keys:
        t0 = time.perf_counter()
        if op == "put":
            assert client.put([(k, src)]) == [True]
        else:
            got = client.get([k], alloc)
            assert got is not None and got[0] is not None
            got[0].ref_count_down()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    client.remove(keys)
    return dt


async def _redis_vs_server(
    opts: BenchOptions,
    client: ServerClient,
    url: str,
    staging: PoolAllocator,
    alloc: Allocate,
    src: MemoryObj,
    count: int,
) -> list[Result]:
    """Put and get of 1 MiB through the node server vs the Redis tier at ``url``, rounds
    alternating (the first warms both); throughput rows."""
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.remote import RemoteBackend
    from lmcache_async.tiers import BackendContext

    ids = itertools.count(1000)
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(4)
    ctx = BackendContext(
        config=LMCacheEngineConfig.from_defaults(remote_url=url, remote_key_prefix="benchsrv"),
        metadata=LMCacheEngineMetadata("bench/server"),
        cache_name="bench",
        loop=loop,
        executor=executor,
        staging=alloc,
        staging_pool=staging,
        pool=None,
    )
    be = RemoteBackend(ctx, timeout_s=60.0)
    await be.start()
    try:
        out = []
        for op in ("put", "get"):
            srv_s, red_s = [], []
            for r in range(opts.reps + 1):
                a = _server_round(client, src, alloc, ids, count, op)
                b = await _redis_round(be, src, ids, count, op)
                if r:  # the first round warms both
                    srv_s.append(a)
                    red_s.append(b)
            srv_s.sort()
            red_s.sort()
            t_srv, t_red = srv_s[len(srv_s) // 2], red_s[len(red_s) // 2]
            out.append(
                Result(
                    SUITE,
                    f"{op} 1 MiB vs Redis tier",
                    MiB / t_srv / 1e9,
                    "GB/s",
                    f"Redis tier {op} (loopback)",
                    MiB / t_red / 1e9,
                    higher_is_better=True,
                    target=3.0,
                    target_kind="min",
                )
            )
        return out
    finally:
        await be.close()
        executor.shutdown(wait=False)


def redis_figures(opts: BenchOptions, client: ServerClient, url: str) -> list[Result]:
    """The node server vs the Redis tier at ``url`` (:func:`_redis_vs_server`), on one 1 MiB
    source entry and a staging pool of its own."""
    from lmcache_async.memory import HeapAllocator

    count = 16 if opts.quick else 64
    staging = PoolAllocator(64 * MiB, name="bench-staging-r")
    staging.wait_ready(30)
    heap = HeapAllocator("bench-heap")
    srcs_pool = PoolAllocator(8 * MiB, name="bench-src-r", pretouch=False)
    src = srcs_pool.allocate((256, 1024), torch.float32, MemoryFormat.EC_TD)
    assert src is not None
    src.tensor.copy_(torch.randn(256, 1024))

    def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return staging.allocate(shape, dtype, fmt) or heap.allocate(shape, dtype, fmt)

    try:
        return asyncio.run(_redis_vs_server(opts, client, url, staging, alloc, src, count))
    finally:
        src.ref_count_down()
