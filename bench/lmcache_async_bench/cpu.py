"""CPU-tier, sync-bridge and hashing figures (the spine's acceptance numbers).

* ``put_sync`` of 1 MiB float32 vs the copy baseline (rotating, DRAM-bound);
* ``contains_sync`` hit/miss, ``get_sync`` of a present entry (absolute µs);
* ``await get`` from a foreign loop (a CPU hit, and a lower-tier miss path) vs the bare
  ``run_coroutine_threadsafe`` hop;
* ``prefix_len_sync`` of 256 keys per key;
* token hashing (chunk 256, list input) in tokens/s.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.loop import LoopThread
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

from .common import BenchOptions, CopyBaseline, MiB, Result, median_time

__all__ = ["SUITE", "bench_hashing", "bench_lookups", "bench_put", "run"]

SUITE = "cpu"


def _manager(gib: float) -> StorageManager:
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=gib, staging_size=0)
    sm = StorageManager(cfg, LMCacheEngineMetadata("bench"), name="bench-cpu")
    assert sm.pool is not None
    sm.pool.wait_ready()
    return sm


def bench_put(opts: BenchOptions) -> list[Result]:
    n = 128 if opts.quick else 512  # entries per repetition: the pool rotates over >= 128 MiB
    sm = _manager((n + 8) / 1024)
    db = ChunkedTokenDatabase(256, metadata=sm.metadata)
    srcs = [torch.randn(MiB // 4) for _ in range(64)]
    base = CopyBaseline(MiB, span=max(n, 128) * MiB)
    keys_iter = iter(range(1 << 62))

    def one_round() -> None:
        sm.clear_sync()
        keys = [db.make_key(next(keys_iter)) for _ in range(n)]
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            sm.put_sync(k, srcs[i % 64])
        samples.append((time.perf_counter() - t0) / n)

    samples: list[float] = []
    base_samples: list[float] = []
    for _ in range(opts.warmup):
        one_round()
        base.measure(reps=1)
    samples.clear()
    for _ in range(opts.reps):  # alternate A/B so drift hits both
        one_round()
        base_samples.append(base.measure(reps=1, inner=n))
    sm.close_sync()
    import statistics

    return [
        Result(
            SUITE,
            "put_sync 1 MiB float32",
            statistics.median(samples) * 1e6,
            "µs",
            "copy_ 1 MiB (rotating)",
            statistics.median(base_samples) * 1e6,
            target=1.25,
        ),
    ]


def _bench_foreign_await(opts: BenchOptions, sm: StorageManager, hit: CacheEngineKey, inner: int) -> list[Result]:
    """``await get`` of the present key ``hit`` from a foreign loop, and the bridge a lower-tier
    miss takes to the manager loop, each beside the bare ``run_coroutine_threadsafe`` hop."""
    hop = LoopThread("bench-hop")

    async def noop() -> None:
        return None

    def bare_hop() -> None:
        asyncio.run_coroutine_threadsafe(noop(), hop.loop).result()

    hop_t = median_time(bare_hop, opts.reps, 1, inner // 20)
    hop.stop()

    async def foreign() -> tuple[float, float]:
        n = inner // 20

        async def hit_loop() -> None:
            for _ in range(n):
                obj = await sm.get(hit)
                assert obj is not None
                obj.ref_count_down()

        async def miss_via_hop() -> None:
            for _ in range(n):
                await sm.loop_thread.run_async(noop())  # the bridge a lower-tier miss takes

        samples_hit, samples_hop = [], []
        for _ in range(opts.reps):
            t0 = time.perf_counter()
            await hit_loop()
            samples_hit.append((time.perf_counter() - t0) / n)
            t0 = time.perf_counter()
            await miss_via_hop()
            samples_hop.append((time.perf_counter() - t0) / n)
        import statistics

        return statistics.median(samples_hit), statistics.median(samples_hop)

    hit_t, bridge_t = asyncio.run(foreign())
    return [
        Result(
            SUITE,
            "await get (hit) from a foreign loop",
            hit_t * 1e6,
            "µs",
            "bare run_coroutine_threadsafe hop",
            hop_t * 1e6,
            target=1.2,
        ),
        Result(
            SUITE,
            "await bridge to the manager loop",
            bridge_t * 1e6,
            "µs",
            "bare run_coroutine_threadsafe hop",
            hop_t * 1e6,
            target=1.2,
        ),
    ]


def bench_lookups(opts: BenchOptions) -> list[Result]:
    """The sync lookups (contains hit/miss, get, prefix_len) and the foreign-loop awaits
    (:func:`_bench_foreign_await`), on a manager holding 1024 small entries."""
    sm = _manager(0.25)
    db = ChunkedTokenDatabase(256, metadata=sm.metadata)
    keys = [db.make_key(i) for i in range(1024)]
    for k in keys:
        sm.put_sync(k, torch.zeros(64))
    hit, miss = keys[500], db.make_key(1 << 40)
    inner = 20_000 if not opts.quick else 2000
    out = [
        Result(
            SUITE,
            "contains_sync hit",
            median_time(lambda: sm.contains_sync(hit), opts.reps, 1, inner) * 1e6,
            "µs",
            target=3.0,
        ),
        Result(
            SUITE,
            "contains_sync miss",
            median_time(lambda: sm.contains_sync(miss), opts.reps, 1, inner) * 1e6,
            "µs",
            target=3.0,
        ),
    ]

    def get_release() -> None:
        obj = sm.get_sync(hit)
        assert obj is not None
        obj.ref_count_down()

    out.append(
        Result(SUITE, "get_sync hit (+release)", median_time(get_release, opts.reps, 1, inner) * 1e6, "µs", target=5.0)
    )
    batch = keys[:256]
    per_key = median_time(lambda: sm.prefix_len_sync(batch), opts.reps, 1, inner // 50) / 256
    out.append(Result(SUITE, "prefix_len_sync 256 keys, per key", per_key * 1e6, "µs", target=1.0))

    out += _bench_foreign_await(opts, sm, hit, inner)
    sm.close_sync()
    return out


def bench_hashing(opts: BenchOptions) -> list[Result]:
    rng = random.Random(0)
    tokens = [rng.randrange(152_000) for _ in range(131_072 if not opts.quick else 32_768)]
    db = ChunkedTokenDatabase(256)
    t = median_time(lambda: list(db.process_tokens(tokens)), opts.reps, 1, 1)
    rate = len(tokens) / t / 1e6
    return [
        Result(
            SUITE,
            "token hashing, chunk 256, list input",
            rate,
            "M tokens/s",
            higher_is_better=True,
            target=10.0,
            target_kind="min",
        )
    ]


def run(opts: BenchOptions) -> list[Result]:
    opts.say("cpu: put_sync vs copy baseline")
    out = bench_put(opts)
    opts.say("cpu: contains/get/prefix_len and the bridge")
    out += bench_lookups(opts)
    opts.say("cpu: token hashing")
    out += bench_hashing(opts)
    return out


if __name__ == "__main__":
    from .common import format_table

    print(format_table(run(BenchOptions(progress=print))))
