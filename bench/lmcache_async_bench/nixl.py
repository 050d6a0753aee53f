"""NIXL-tier figures: put/get throughput through the tier vs a bare NIXL transfer.

For 64 MiB and 1 MiB entries, in both storage layouts (one file per entry; pre-created slot
files), measured in the same run:

* **baseline** — a bare NIXL POSIX transfer of the same payload bytes with the same agent
  settings (strict thread sync, no progress thread, default POSIX parameters): one request per
  entry between the same registered pool blocks and pre-created, pre-registered files, posted
  and polled to completion on the calling thread. No header, no checksum, no file creation.
* **tier** — ``await put`` / ``await get`` of the same blocks through :class:`NixlBackend`
  (header + xxh3 checksum on write, full verification on read), one call at a time (a thread
  hand-off each way per call); for the 1 MiB entries also all calls in flight at once
  (``asyncio.gather``: the tier hands them to its worker together) and
  ``batched_put``/``batched_get`` (one hand-off per batch, as the manager's write-through and
  batched reads use it). Target: tier >= 0.6 x baseline for the transfer-bound figures — 64 MiB
  entries, and 1 MiB entries in batches. The per-call figures of 1 MiB entries (one at a time,
  all in flight) are reported beside them without a target: each call crosses to the worker
  thread and back (about the time of the 1 MiB transfer itself on a small host), and the
  manager never drives a tier that way (docs/benchmarks.md, "What limits each ratio").
* **disk tier** on the same filesystem, same entries (built through the registry; the line
  is left out, with a note, when the disk tier is not installed).

Sources rotate over >= 128 MiB of the pool (DRAM-bound, like a real pool); files stay in the
page cache (no ``drop_caches``): the figures compare code paths, not the disk.

Run: ``python -m lmcache_async_bench.nixl [--quick] [--reps N] [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.tiers import BackendContext, StorageBackend, get_backend_factory

from .common import BenchOptions, MiB, Result, format_table

__all__ = ["SUITE", "TARGET", "main", "run"]

SUITE = "nixl"
TARGET = 0.6


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench/nixl", 1, 0, (i * 0x9E3779B97F4A7C15 + 1) & ((1 << 64) - 1), torch.bfloat16)


class _Fixture:
    """Pool, staging, context and entries shared by every measurement of one entry size."""

    def __init__(self, entry_bytes: int, count: int, workdir: Path) -> None:
        self.entry_bytes = entry_bytes
        self.count = count
        self.workdir = workdir
        span = entry_bytes * count
        # sources + read destinations + room for the disk tier's reads
        self.pool = PoolAllocator(3 * span + 64 * MiB, name="bench-nixl-pool")
        self.staging = PoolAllocator(64 * MiB, name="bench-nixl-staging")
        self.pool.wait_ready()
        self.staging.wait_ready()
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-bench-io")
        self.srcs: list[MemoryObj] = []
        for i in range(count):
            obj = self.pool.allocate((entry_bytes // 2,), torch.bfloat16, MemoryFormat.KV_2LTD)
            assert obj is not None
            obj.tensor.copy_(torch.randn(entry_bytes // 2, generator=torch.Generator().manual_seed(i)))
            self.srcs.append(obj)
        self._key_base = 0

    def context(self, loop: asyncio.AbstractEventLoop, **config: Any) -> BackendContext:
        pool = self.pool

        def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
            return pool.allocate(shape, dtype, fmt)

        return BackendContext(
            config=LMCacheEngineConfig.from_defaults(**config),
            metadata=LMCacheEngineMetadata("bench"),
            cache_name="bench",
            loop=loop,
            executor=self.executor,
            staging=alloc,
            staging_pool=self.staging,
            pool=self.pool,
        )

    def fresh_keys(self) -> list[CacheEngineKey]:
        base = self._key_base
        self._key_base += self.count
        return [_key(base + i) for i in range(self.count)]

    def close(self) -> None:
        for o in self.srcs:
            o.ref_count_down()
        self.executor.shutdown(wait=True)


class _Bare:
    """The baseline: bare NIXL transfers of the payloads to pre-created, registered files."""

    def __init__(self, fx: _Fixture) -> None:
        from lmcache_async.nixl.agent import NixlAgent

        self.fx = fx
        self.agent = NixlAgent("lmcache-async-bench-bare", "POSIX", {})
        self.regions = [self.agent.register_dram(p.base_ptr, p.capacity) for p in (fx.pool, fx.staging)]
        d = fx.workdir / "bare"
        d.mkdir(parents=True, exist_ok=True)
        self.fds: list[int] = []
        self.targets: list[tuple[int, Any]] = []
        for i in range(fx.count):
            fd = os.open(d / f"bare-{i}", os.O_RDWR | os.O_CREAT, 0o644)
            self.fds.append(fd)
            self.targets.append(self.agent.register_target(fd=fd))
        self.dsts = [fx.pool.allocate(o.shape, o.dtype, o.fmt) for o in fx.srcs]
        self.write()

    def write(self) -> None:
        for o, (dev, _) in zip(self.fx.srcs, self.targets, strict=True):
            self.agent.transfer("WRITE", [(o.data_ptr, o.nbytes)], [(0, o.nbytes, dev)])

    def write_fresh(self) -> float:
        """Seconds to write every payload to a new file (create, register, write, close);
        the files are deleted afterwards, untimed."""
        d = self.fx.workdir / "bare-fresh"
        d.mkdir(parents=True, exist_ok=True)
        paths = [d / f"fresh-{i}" for i in range(len(self.fx.srcs))]
        t0 = time.perf_counter()
        for o, path in zip(self.fx.srcs, paths, strict=True):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            dev, h = self.agent.register_target(fd=fd)
            self.agent.transfer("WRITE", [(o.data_ptr, o.nbytes)], [(0, o.nbytes, dev)])
            self.agent.deregister(h)
            os.close(fd)
        t = time.perf_counter() - t0
        for path in paths:
            path.unlink()
        return t

    def read(self) -> None:
        for d, (dev, _) in zip(self.dsts, self.targets, strict=True):
            assert d is not None
            self.agent.transfer("READ", [(d.data_ptr, d.nbytes)], [(0, d.nbytes, dev)])

    def close(self) -> None:
        for _, h in self.targets:
            self.agent.deregister(h)
        for h in self.regions:
            self.agent.deregister(h)
        for fd in self.fds:
            os.close(fd)
        for d in self.dsts:
            if d is not None:
                d.ref_count_down()
        self.agent.close()


async def _time_async(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _settle(backend: StorageBackend) -> None:
    """Let background deletions of a previous round finish (not timed)."""
    tasks = getattr(backend, "_tasks", None)
    while tasks:
        await asyncio.gather(*list(tasks), return_exceptions=True)


class _TierRounds:
    """Timed put/get rounds of every entry through one backend."""

    def __init__(self, fx: _Fixture, backend: StorageBackend, calls: str, fresh: bool) -> None:
        """``calls``: ``"one"`` (one call at a time), ``"concurrent"`` (every call in flight
        at once) or ``"batched"`` (one ``batched_put``/``batched_get``)."""
        self.fx = fx
        self.backend = backend
        self.calls = calls
        self.fresh = fresh
        self.keys: list[CacheEngineKey] = []

    async def put_round(self) -> float:
        """Put ``count`` new keys. Steady state (``fresh=False``): the tier is full and each
        put evicts the least recently used entry. Fresh: the tier was cleared first."""
        if self.fresh:
            await self.backend.clear()
        await _settle(self.backend)
        keys = self.fx.fresh_keys()
        self.keys = keys
        be = self.backend
        srcs = self.fx.srcs

        async def run() -> None:
            if self.calls == "batched":
                ok = await be.batched_put(list(zip(keys, srcs, strict=True)))
            elif self.calls == "concurrent":
                ok = await asyncio.gather(*(be.put(k, o) for k, o in zip(keys, srcs, strict=True)))
            else:
                ok = [await be.put(k, o) for k, o in zip(keys, srcs, strict=True)]
            if not all(ok):
                raise RuntimeError(f"{be.name}: a put failed: {be.stats()}")

        return await _time_async(run)

    async def get_round(self) -> float:
        be = self.backend
        got: list[MemoryObj | None] = []

        async def run() -> None:
            if self.calls == "batched":
                got.extend(await be.batched_get(self.keys, None))
            elif self.calls == "concurrent":
                got.extend(await asyncio.gather(*(be.get(k, None) for k in self.keys)))
            else:
                for k in self.keys:
                    got.append(await be.get(k, None))

        t = await _time_async(run)
        missing = sum(1 for g in got if g is None)
        for g in got:
            if g is not None:
                g.ref_count_down()
        if missing:
            raise RuntimeError(f"{be.name}: {missing} gets missed: {be.stats()}")
        return t


async def _measure_pair(opts: BenchOptions, rounds: _TierRounds, bare: _Bare) -> tuple[float, float, float, float]:
    """Median seconds of (tier put, bare write, tier get, bare read), rounds interleaved.
    The bare write goes to new files when the tier's round starts from an empty tier."""
    tp: list[float] = []
    tg: list[float] = []
    bp: list[float] = []
    bg: list[float] = []
    for r in range(opts.warmup + opts.reps):
        a = await rounds.put_round()
        if rounds.fresh:
            b = bare.write_fresh()
        else:
            t0 = time.perf_counter()
            bare.write()
            b = time.perf_counter() - t0
        c = await rounds.get_round()
        t0 = time.perf_counter()
        bare.read()
        d = time.perf_counter() - t0
        if r >= opts.warmup:
            tp.append(a)
            bp.append(b)
            tg.append(c)
            bg.append(d)
    return statistics.median(tp), statistics.median(bp), statistics.median(tg), statistics.median(bg)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _disk_backend(fx: _Fixture, loop: asyncio.AbstractEventLoop, budget_gib: float) -> StorageBackend | str:
    """The disk tier on the same filesystem, or why it is left out."""
    d = fx.workdir / "disk"
    try:
        factory = get_backend_factory("disk")
        be = factory(fx.context(loop, local_disk=str(d), max_local_disk_size=budget_gib))
    except (BackendUnavailableError, ImportError) as exc:
        return f"disk tier not available: {exc}"
    if be is None:
        return "disk tier not configured"
    start = getattr(be, "start", None)
    if start is not None:
        await start()
    return be


async def _variant_rows(
    opts: BenchOptions,
    fx: _Fixture,
    bare: _Bare,
    variant: tuple[str, int, str, bool],
    label: str,
    budget: int,
    workdir: Path,
) -> tuple[list[Result], float, float]:
    """One NIXL-tier variant (layout, pool size, call style, fresh files) against the bare NIXL
    transfers: its put and get rows, and its put and get seconds."""
    from lmcache_async.nixl.tier import NixlBackend, NixlSettings

    layout, pool_size, calls, fresh = variant
    count, total = fx.count, fx.entry_bytes * fx.count
    root = workdir / f"nixl-{layout}"
    settings = NixlSettings(plugin="POSIX", path=str(root), pool_size=pool_size, max_bytes=budget)
    be = NixlBackend(fx.context(asyncio.get_running_loop()), settings)
    await be.start()
    mode = "fresh files" if fresh else layout
    try:
        opts.say(f"nixl {label} {mode} {calls}")
        tp, bp, tg, bg = await _measure_pair(opts, _TierRounds(fx, be, calls, fresh), bare)
    finally:
        await be.clear()
        await be.close()
        shutil.rmtree(root, ignore_errors=True)
    put_how, get_how = {
        "one": ("put", "get"),
        "concurrent": (f"{count} put in flight", f"{count} get in flight"),
        "batched": ("batched_put", "batched_get"),
    }[calls]
    note = f"{count} x {label}, {mode}" + ("" if fresh else ", tier full (each put evicts)")
    # Transfer-bound figures carry the target; per-call ones of small entries are
    # bound by the thread hand-off of each call (see the module docstring).
    target = TARGET if fx.entry_bytes >= 8 * MiB or calls == "batched" else None
    if target is None:
        note += "; per-call latency, informational"
    rows = [
        Result(SUITE, f"{put_how} {label} ({mode})", _gbps(total, tp), "GB/s",
               "bare NIXL write" + (" to new files" if fresh else ""), _gbps(total, bp),
               higher_is_better=True, target=target, target_kind="min", note=note),
        Result(SUITE, f"{get_how} {label} ({mode})", _gbps(total, tg), "GB/s", "bare NIXL read", _gbps(total, bg),
               higher_is_better=True, target=target, target_kind="min", note=note),
    ]  # fmt: skip
    return rows, tp, tg


async def _disk_rows(
    opts: BenchOptions, fx: _Fixture, bare: _Bare, label: str, budget: int, nixl_put: float, nixl_get: float
) -> list[Result]:
    """The disk tier on the same filesystem and budget, beside the NIXL tier's file layout."""
    total = fx.entry_bytes * fx.count
    disk = await _disk_backend(fx, asyncio.get_running_loop(), budget / (1 << 30))  # same budget: steady state too
    if isinstance(disk, str):
        return [Result(SUITE, f"disk tier {label}", float("nan"), "GB/s", note=disk)]
    try:
        opts.say(f"disk {label}")
        tp, _, tg, _ = await _measure_pair(opts, _TierRounds(fx, disk, calls="one", fresh=False), bare)
    finally:
        await disk.clear()
        await disk.close()
    note = f"{fx.count} x {label}, same filesystem"
    return [
        Result(SUITE, f"disk tier put {label}", _gbps(total, tp), "GB/s", "nixl tier put (files)", nixl_put,
               higher_is_better=True, note=note),
        Result(SUITE, f"disk tier get {label}", _gbps(total, tg), "GB/s", "nixl tier get (files)", nixl_get,
               higher_is_better=True, note=note),
    ]  # fmt: skip


async def _bench_size(opts: BenchOptions, entry_bytes: int, count: int, label: str, workdir: Path) -> list[Result]:
    """Every variant of the NIXL tier at one entry size, then the disk tier beside its file layout."""
    fx = _Fixture(entry_bytes, count, workdir)
    total = entry_bytes * count
    # Room for exactly ``count`` records: in the steady state every put evicts one entry.
    budget = total + count * 4096 + entry_bytes // 2
    bare = _Bare(fx)
    out: list[Result] = []
    nixl_put: dict[str, float] = {}
    nixl_get: dict[str, float] = {}
    try:
        # (layout, nixl_pool_size, calls, fresh)
        variants: list[tuple[str, int, str, bool]] = [
            ("files", 0, "one", False),
            ("slots", count, "one", False),
            ("files", 0, "one", True),
        ]
        if entry_bytes < 8 * MiB:
            variants += [
                (layout, size, calls, False)
                for calls in ("concurrent", "batched")
                for layout, size in (("files", 0), ("slots", count))
            ]
        for variant in variants:
            rows, tp, tg = await _variant_rows(opts, fx, bare, variant, label, budget, workdir)
            out.extend(rows)
            layout, _, calls, fresh = variant
            if calls == "one" and not fresh:
                nixl_put[layout] = _gbps(total, tp)
                nixl_get[layout] = _gbps(total, tg)
        out.extend(await _disk_rows(opts, fx, bare, label, budget, nixl_put["files"], nixl_get["files"]))
    finally:
        bare.close()
        fx.close()
    return out


async def _run(opts: BenchOptions) -> list[Result]:
    root = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="lmcache-async-bench-nixl-"))
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nixl-", dir=root))
    try:
        big = 2 if opts.quick else 4  # 64 MiB entries: 128-256 MiB of sources
        small = 32 if opts.quick else 128  # 1 MiB entries: 32-128 MiB of sources
        results = await _bench_size(opts, 64 * MiB, big, "64 MiB", work)
        results += await _bench_size(opts, MiB, small, "1 MiB", work)
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not opts.workdir:
            shutil.rmtree(root, ignore_errors=True)


def run(opts: BenchOptions) -> list[Result]:
    """Every figure of this suite (needs NIXL: ``pip install 'lmcache-async[nixl]'``)."""
    from lmcache_async.nixl.agent import load_nixl

    load_nixl()
    try:
        return asyncio.run(_run(opts))
    finally:
        os.sync()  # leave no dirty pages behind: the next suite must not pay for our writeback


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="fewer entries (smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="directory for the files (default: a temp dir)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    opts = BenchOptions(
        reps=max(args.reps, 1),
        quick=args.quick,
        workdir=args.workdir,
        progress=(lambda m: print(f"... {m}", flush=True)) if args.verbose else None,
    )
    print(format_table(run(opts)))


if __name__ == "__main__":
    main()
