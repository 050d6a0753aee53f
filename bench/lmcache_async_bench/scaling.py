"""Concurrency scaling and size-scaling figures (suite ``scaling``).

* **async tasks, 1-64** — N tasks on one foreign event loop, each awaiting ``sm.get`` of a
  64 KiB entry and copying it out (a CPU hit: answered on the caller's thread), beside N tasks
  doing a locked dict lookup + the same ``copy_`` (the physical floor). Then the loop path:
  ``await sm.get`` of disk-only entries (no CPU tier: a hop to the manager's loop, one executor
  job per file), beside N tasks awaiting ``run_in_executor(readinto)`` of the same bytes from
  plain files on an executor of the same width (the file baseline).
* **sync caller threads, 1-8** — the same two workloads from N threads calling ``get_sync``,
  beside N threads doing the physical work directly (dict lookup + ``copy_``; ``readinto``).
* **memory per entry** — RSS growth per entry while 10^6 small (64 B) entries are put in the
  CPU tier (the pool itself is pre-touched before the count starts, so this is index + object
  overhead), beside a bare ``dict[key] = int`` over the same keys.
* **contains at 10^6 vs 10^3 entries** — ``contains_sync`` latency over present keys probed in
  random order (hit) and absent keys (miss); the baseline is the same call on a 10^3-entry tier.
  It must stay flat: the miss ratio <= 1.5, and the hit's growth from 10^3 to 10^6 entries at
  most 1.5 x the growth of a bare locked ``dict`` probed with the same keys (a table that
  outgrows the CPU caches pays DRAM misses whatever the code around it).

Throughputs are in thousands of operations per second (``kops/s``; higher is better) with
``params["concurrency"]`` for the plot; entry size is in ``params["size"]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

from .common import BenchOptions, MiB, Result, alternate

__all__ = ["ASYNC_LEVELS", "ENTRY", "SUITE", "THREAD_LEVELS", "bench_concurrency", "bench_memory_and_contains", "run"]

SUITE = "scaling"
ENTRY = 64 << 10
ASYNC_LEVELS = (1, 2, 4, 8, 16, 32, 64)
THREAD_LEVELS = (1, 2, 4, 8)
_META = LMCacheEngineMetadata("bench-scaling")


def _touched(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)
    return t


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Ring:
    """Pre-touched destination buffers rotating over ``span`` bytes (DRAM-bound copies)."""

    def __init__(self, nbytes: int, span: int) -> None:
        self.bufs = [_touched(nbytes) for _ in range(max(4, span // nbytes))]
        self.i = 0

    def next(self) -> torch.Tensor:
        i = self.i  # a benign race between threads only changes which buffer is used
        self.i = i + 1
        return self.bufs[i % len(self.bufs)]


# ---- shared fixtures ---------------------------------------------------------------------------
class _CpuFixture:
    """A CPU-tier manager holding ``n`` entries of ``ENTRY`` bytes plus the same bytes in a dict."""

    def __init__(self, n: int) -> None:
        gib = (n * ENTRY * 1.25 + 16 * MiB) / (1 << 30)
        cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=gib, staging_size=0)
        self.sm = StorageManager(cfg, _META, name="bench-scale-cpu")
        if self.sm.pool is not None:
            self.sm.pool.wait_ready()
        db = ChunkedTokenDatabase(256, metadata=_META)
        self.keys = [db.make_key(i + 1) for i in range(n)]
        src = [torch.randn(ENTRY // 4) for _ in range(16)]
        self.plain: dict[CacheEngineKey, torch.Tensor] = {}
        for i, k in enumerate(self.keys):
            if not self.sm.put_sync(k, src[i % 16]):
                raise RuntimeError("scaling: CPU pool too small")
            self.plain[k] = _touched(ENTRY).view(torch.float32)
            self.plain[k].copy_(src[i % 16])
        self.lock = threading.Lock()
        self.ring = _Ring(ENTRY, 128 * MiB)

    def ours_op(self, i: int) -> None:
        obj = self.sm.get_sync(self.keys[i % len(self.keys)])
        assert obj is not None
        try:
            self.ring.next().view(torch.float32).copy_(obj.tensor)
        finally:
            obj.ref_count_down()

    async def ours_aop(self, i: int) -> None:
        obj = await self.sm.get(self.keys[i % len(self.keys)])
        assert obj is not None
        try:
            self.ring.next().view(torch.float32).copy_(obj.tensor)
        finally:
            obj.ref_count_down()

    def base_op(self, i: int) -> None:
        with self.lock:
            src = self.plain[self.keys[i % len(self.keys)]]
        self.ring.next().view(torch.float32).copy_(src)

    async def base_aop(self, i: int) -> None:
        self.base_op(i)

    def close(self) -> None:
        self.sm.close_sync()


class _DiskFixture:
    """A disk-only manager (no CPU tier) holding ``n`` entries, and the same bytes as plain files."""

    def __init__(self, n: int, workdir: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="scaling-", dir=workdir)
        cfg = LMCacheEngineConfig.from_defaults(
            local_cpu=False,
            max_local_cpu_size=0,
            local_disk=os.path.join(self.dir, "tier"),
            max_local_disk_size=(n * ENTRY * 2 + 64 * MiB) / (1 << 30),
            staging_size=(64 * MiB) / (1 << 30),
        )
        self.sm = StorageManager(cfg, _META, name="bench-scale-disk")
        if not self.sm.has_lower_tiers:
            self.sm.close_sync()
            raise RuntimeError("the disk tier is not available")
        self.workers = cfg.executor_workers
        db = ChunkedTokenDatabase(256, metadata=_META)
        self.keys = [db.make_key(i + 1) for i in range(n)]
        src = [torch.randn(ENTRY // 4) for _ in range(16)]
        for i, k in enumerate(self.keys):
            if not self.sm.put_sync(k, src[i % 16]):  # staging full of pending writes: drain it
                self.sm.flush_sync()
                if not self.sm.put_sync(k, src[i % 16]):
                    raise RuntimeError("the disk tier refused an entry")
        self.sm.flush_sync()
        self.paths = []
        for i in range(n):
            p = os.path.join(self.dir, f"{i:06d}.bin")
            with open(p, "wb") as f:
                f.write(src[i % 16].numpy().tobytes())
            self.paths.append(p)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="bench-raw-io")
        self.ring = _Ring(ENTRY, 128 * MiB)
        probe = self.sm.get_sync(self.keys[0])
        if probe is None:
            self.close()
            raise RuntimeError("the disk tier did not return a stored entry")
        probe.ref_count_down()

    def _read(self, i: int) -> int:
        buf = self.ring.next().numpy().data
        with open(self.paths[i % len(self.paths)], "rb", buffering=0) as f:
            return f.readinto(buf) or 0

    def ours_op(self, i: int) -> None:
        obj = self.sm.get_sync(self.keys[i % len(self.keys)])
        assert obj is not None
        obj.ref_count_down()

    async def ours_aop(self, i: int) -> None:
        obj = await self.sm.get(self.keys[i % len(self.keys)])
        assert obj is not None
        obj.ref_count_down()

    def base_op(self, i: int) -> None:
        self._read(i)

    async def base_aop(self, i: int) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self._read, i)

    def close(self) -> None:
        self.sm.close_sync()
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- drivers -----------------------------------------------------------------------------------
def _async_rate(op: Callable[[int], Awaitable[None]], tasks: int, total: int) -> float:
    """Seconds per operation with ``tasks`` concurrent tasks doing ``total`` operations."""
    per = max(1, total // tasks)

    async def main() -> float:
        async def worker(t: int) -> None:
            base = t * per
            for i in range(per):
                await op(base + i)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(t) for t in range(tasks)))
        return (time.perf_counter() - t0) / (per * tasks)

    return asyncio.run(main())


def _thread_rate(op: Callable[[int], None], threads: int, total: int) -> float:
    """Seconds per operation with ``threads`` caller threads doing ``total`` operations."""
    per = max(1, total // threads)
    start = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        start.wait()
        try:
            base = t * per
            for i in range(per):
                op(base + i)
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(t,), name=f"bench-caller-{t}") for t in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt / (per * threads)


def _scaling_results(
    opts: BenchOptions, fx: Any, what: str, panel_kind: str, levels: tuple[int, ...], total: int, base_name: str
) -> list[Result]:
    out = []
    for n in levels:
        opts.say(f"scaling: {what}, {panel_kind} = {n}")
        if panel_kind == "async tasks":
            fns = [lambda n=n: _async_rate(fx.ours_aop, n, total), lambda n=n: _async_rate(fx.base_aop, n, total)]
        else:
            fns = [lambda n=n: _thread_rate(fx.ours_op, n, total), lambda n=n: _thread_rate(fx.base_op, n, total)]
        ours, base = alternate(fns, reps=opts.reps, warmup=opts.warmup)
        out.append(
            Result(
                SUITE,
                f"{what}, {n} {panel_kind}",
                1e-3 / ours,
                "kops/s",
                base_name,
                1e-3 / base,
                higher_is_better=True,
                params={"concurrency": n, "size": ENTRY, "series": what, "panel": f"scaling: {panel_kind}"},
            )
        )
    return out


def bench_concurrency(opts: BenchOptions) -> list[Result]:
    n_entries = 256 if opts.quick else 2048
    total = 256 if opts.quick else 16384  # operations per measurement: >= 0.1 s, many time slices
    disk_total = 64 if opts.quick else 2048
    a_levels = (1, 8, 64) if opts.quick else ASYNC_LEVELS
    t_levels = (1, 4) if opts.quick else THREAD_LEVELS
    out: list[Result] = []
    cpu = _CpuFixture(n_entries)
    try:
        what = "get + copy-out, 64 KiB CPU hit"
        base = "dict lookup + copy_ (rotating)"
        out += _scaling_results(opts, cpu, what, "async tasks", a_levels, total, base)
        out += _scaling_results(opts, cpu, what, "caller threads", t_levels, total, base)
    finally:
        cpu.close()
    workdir = opts.workdir or tempfile.gettempdir()
    try:
        disk = _DiskFixture(n_entries, workdir)
    except Exception as exc:  # the disk tier is optional in a checkout under construction
        opts.say(f"scaling: disk path skipped: {type(exc).__name__}: {exc}")
        return out
    try:
        what = "get, 64 KiB disk-only entry (page cache)"
        out += _scaling_results(
            opts, disk, what, "async tasks", a_levels, disk_total, "run_in_executor(readinto), same workers"
        )
        out += _scaling_results(opts, disk, what, "caller threads", t_levels, disk_total, "readinto per thread")
    finally:
        disk.close()
    return out


def _contains_rate(m: StorageManager, probe: list[CacheEngineKey]) -> Callable[[], float]:
    """A timer of ``m.contains_sync`` over ``probe``: seconds per call."""

    def one() -> float:
        c = m.contains_sync
        t0 = time.perf_counter()
        for k in probe:
            c(k)
        return (time.perf_counter() - t0) / len(probe)

    return one


def _dict_rate(d: dict[CacheEngineKey, int], probe: list[CacheEngineKey], lock: threading.Lock) -> Callable[[], float]:
    """A timer of a bare lookup in ``d`` under ``lock`` over ``probe``: seconds per lookup."""

    def one() -> float:
        t0 = time.perf_counter()
        for k in probe:
            with lock:
                k in d  # noqa: B015 - the lookup is what is timed
        return (time.perf_counter() - t0) / len(probe)

    return one


def _dict_bytes_per_entry(keys: list[CacheEngineKey]) -> float:
    """Resident bytes per entry of a plain ``dict[key] = int`` over ``keys`` (the baseline)."""
    gc.collect()
    r0 = _rss()
    plain = {k: i for i, k in enumerate(keys)}
    dict_per_entry = (_rss() - r0) / len(keys)
    del plain
    gc.collect()
    return dict_per_entry


def _memory_figure(
    opts: BenchOptions, sm: StorageManager, keys: list[CacheEngineKey], payload: torch.Tensor, dict_per_entry: float
) -> Result:
    """Put every key of ``keys`` (64 B entries) into ``sm``'s fresh CPU tier: resident bytes per
    entry beside the plain dict's."""
    big = len(keys)
    assert sm.pool is not None
    sm.pool.wait_ready()
    sm.pool.buffer.fill_(0)  # every page of the pool resident before counting
    gc.collect()
    opts.say(f"scaling: putting {big:,} entries of 64 B")
    r0 = _rss()
    t0 = time.perf_counter()
    for k in keys:
        if not sm.put_sync(k, payload):
            raise RuntimeError("scaling: pool too small for the memory figure")
    put_s = (time.perf_counter() - t0) / big
    gc.collect()
    per_entry = (_rss() - r0) / big
    pool_per_entry = sm.pool.stats()["used_bytes"] / big
    return Result(
        SUITE,
        f"memory per entry, {big:,} x 64 B in the CPU tier (index + objects)",
        per_entry,
        "B",
        "dict[key] = int over the same keys",
        dict_per_entry,
        target=None,
        note=f"pool bytes per entry {pool_per_entry:.0f} (alignment); put_sync {put_s * 1e6:.2f} µs",
        params={"entries": big},
    )


def _contains_times(
    opts: BenchOptions,
    sm: StorageManager,
    keys: list[CacheEngineKey],
    absent: list[CacheEngineKey],
    payload: torch.Tensor,
    small: int,
) -> tuple[float, ...]:
    """Seconds per ``contains_sync`` (hit at ``sm``'s size, hit at ``small`` entries, miss at both)
    and per bare locked dict lookup (at both sizes), in that order, measured in alternation."""
    small_sm = StorageManager(
        LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.01, staging_size=0), _META, name="bench-scale-small"
    )
    try:
        for k in keys[:small]:
            small_sm.put_sync(k, payload)
        rng = random.Random(1)
        probe_big = rng.sample(keys, min(20_000, len(keys)))
        probe_small = [keys[rng.randrange(small)] for _ in range(len(probe_big))]
        big_dict = dict.fromkeys(keys, 0)
        small_dict = dict.fromkeys(keys[:small], 0)
        lock = threading.Lock()
        opts.say("scaling: contains at 10^3 vs 10^6 entries")
        times = alternate(
            [
                _contains_rate(sm, probe_big),
                _contains_rate(small_sm, probe_small),
                _contains_rate(sm, absent),
                _contains_rate(small_sm, absent),
                _dict_rate(big_dict, probe_big, lock),
                _dict_rate(small_dict, probe_small, lock),
            ],
            reps=opts.reps,
            warmup=opts.warmup,
        )
        del big_dict, small_dict
        return tuple(times)
    finally:
        small_sm.close_sync()


def _contains_figures(big: int, small: int, times: tuple[float, ...]) -> list[Result]:
    """The contains rows from :func:`_contains_times`'s ``times`` at ``big`` and ``small`` entries."""
    hit_big, hit_small, miss_big, miss_small, d_big, d_small = times
    label = f"{big:,}"
    return [
        Result(
            SUITE,
            f"contains_sync hit at {label} entries (random keys)",
            hit_big * 1e6,
            "µs",
            f"same call at {small:,} entries",
            hit_small * 1e6,
        ),
        Result(
            SUITE,
            f"contains_sync miss at {label} entries",
            miss_big * 1e6,
            "µs",
            f"same call at {small:,} entries",
            miss_small * 1e6,
            target=1.5,
        ),
        # "Flat" judged against physics: a hash table that outgrows the CPU caches pays DRAM misses
        # on its slots and on the probed key objects whatever the code around it; the figure is our
        # growth from 10^3 to 10^6 entries over a bare locked dict's growth with the same probes.
        Result(
            SUITE,
            f"contains_sync hit growth {small:,} -> {label} entries",
            hit_big / hit_small,
            "x",
            "locked dict lookup growth, same keys",
            d_big / d_small,
            target=1.5,
            note=f"bare locked dict: {d_small * 1e6:.3f} -> {d_big * 1e6:.3f} µs",
        ),
    ]


def bench_memory_and_contains(opts: BenchOptions) -> list[Result]:
    """Memory per entry at 10^6 entries (:func:`_memory_figure`) and ``contains_sync`` at 10^6
    vs 10^3 entries (:func:`_contains_times`, :func:`_contains_figures`)."""
    big = 20_000 if opts.quick else 1_000_000
    small = 1_000
    payload = torch.randn(16)  # 64 B entries
    db = ChunkedTokenDatabase(256, metadata=_META)
    opts.say(f"scaling: building {big:,} keys")
    keys = [db.make_key(i + 1) for i in range(big)]
    absent = [db.make_key(big + 10 + i) for i in range(10_000)]
    dict_per_entry = _dict_bytes_per_entry(keys)
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=(big * 512 + 64 * MiB) / (1 << 30), staging_size=0)
    sm = StorageManager(cfg, _META, name="bench-scale-mem")
    try:
        out = [_memory_figure(opts, sm, keys, payload, dict_per_entry)]
        out += _contains_figures(big, small, _contains_times(opts, sm, keys, absent, payload, small))
        return out
    finally:
        sm.close_sync()


def run(opts: BenchOptions) -> list[Result]:
    opts.say("scaling: throughput vs concurrency")
    out = bench_concurrency(opts)
    opts.say("scaling: memory per entry and contains at 10^6 entries")
    out += bench_memory_and_contains(opts)
    return out


if __name__ == "__main__":
    from .common import format_table

    print(format_table(run(BenchOptions(progress=print))))
