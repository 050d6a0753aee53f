"""Disk-tier figures (1,000 x 1 MiB entries; ``quick``: 200 x 256 KiB), each beside the SPEC §6
file baseline measured in the same run:

* **write-through**: the tier's ``batched_put`` driven like the manager's write-through (batches
  of 64, 4 in flight) vs the file baseline (plain Python, one executor job per whole file, temp
  name + rename, same fsync policy, the same 4 threads); target >= 0.9;
* **cold read** with checksum verification vs raw ``readinto`` of the same files into pre-touched
  buffers (one executor job per file); the page cache is dropped before each repetition
  (``drop_caches`` where permitted) and before each chunk (``POSIX_FADV_DONTNEED`` per file);
  target >= 0.8; the hot (page-cache) read for reference;
* **index rebuild** at start (entries/s; target >= 20,000), warm and cold (reference);
* **I/O style**: aiofiles (a thread hop per open/write/read/close) vs one executor job per whole
  file, both driven from asyncio with the same threads: the tier uses the faster.

The measured path and its baseline run interleaved, chunk by chunk (:func:`interleaved`), so a
slow moment of the shared disk or CPU hits both alike. Throughputs are files/s (higher is
better). ``opts.extra["fsync"]`` picks the policy (``none``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from lmcache_async.disk.layout import ENTRY_SUFFIX, entry_path, key_digest
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import (
    HeapAllocator,
    MemoryFormat,
    MemoryObj,
    PoolAllocator,
    tensor_byte_view,
)

from .common import (
    BenchOptions,
    MiB,
    Result,
    alternate,
    evict_from_page_cache,
)

__all__ = [
    "CHUNK",
    "SUITE",
    "WORKERS",
    "WT_BATCH",
    "WT_INFLIGHT",
    "Interleaved",
    "bench_io_style",
    "bench_read",
    "bench_rebuild",
    "bench_write",
    "drop_page_cache",
    "file_baseline_write",
    "interleaved",
    "run",
]

SUITE = "disk"
WORKERS = 4
WT_BATCH = 64
WT_INFLIGHT = 4
CHUNK = 128  # files per interleaving step


def drop_page_cache(paths: Sequence[str]) -> str:
    """Make the next read of ``paths`` cold; returns how (for the result note)."""
    evict_from_page_cache(paths)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches + fadvise"
    except OSError:
        return "fadvise DONTNEED per file"


def _entry_paths(root: str) -> list[str]:
    out: list[str] = []
    for shard in sorted(os.listdir(root)):
        sdir = os.path.join(root, shard)
        if len(shard) == 2 and os.path.isdir(sdir):
            out.extend(os.path.join(sdir, n) for n in os.listdir(sdir) if n.endswith(ENTRY_SUFFIX))
    return out


class _Rig:
    """One event loop, the tier's executor, sources and a staging area shared by every figure."""

    def __init__(self, opts: BenchOptions) -> None:
        self.n = 200 if opts.quick else 1000
        self.size = (256 << 10) if opts.quick else MiB
        self.fsync = str(opts.extra.get("fsync", "none"))
        self.own_dir = opts.workdir is None
        self.base = opts.workdir or tempfile.mkdtemp(prefix="lmcache-bench-disk-")
        os.makedirs(self.base, exist_ok=True)
        self.loop = asyncio.new_event_loop()
        self.ex = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="lmcache-async-bench-io")
        nsrc = max(1, min(self.n, (64 * MiB) // self.size))
        self.src_pool = PoolAllocator(nsrc * self.size + MiB, name="bench-disk-src", pretouch=False)
        self.srcs: list[MemoryObj] = []
        for _ in range(nsrc):
            o = self.src_pool.allocate((self.size,), torch.uint8, MemoryFormat.BINARY)
            assert o is not None
            o.tensor.copy_(torch.randint(0, 255, (self.size,), dtype=torch.uint8))
            self.srcs.append(o)
        span = max(128 * MiB, (CHUNK + WT_BATCH) * (self.size + 4096) + 16 * MiB)  # reads never spill
        self.staging = PoolAllocator(span, name="bench-disk-staging", pretouch=True)
        self.staging.wait_ready(30)
        self.heap = HeapAllocator("bench-disk-heap", pin=False)
        self.round = 0

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.staging.allocate(shape, dtype, fmt) or self.heap.allocate(shape, dtype, fmt)

    def keys(self, tag: int) -> list[CacheEngineKey]:
        return [CacheEngineKey("bench/disk", 1, 0, (tag << 32) | i, torch.bfloat16) for i in range(self.n)]

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    async def open_backend(self, root: str, ready: bool = True) -> DiskBackend:
        fsync: Any = self.fsync
        be = DiskBackend(root, 1 << 40, executor=self.ex, staging=self.alloc, fsync=fsync)
        await be.start()
        if ready:
            await be.wait_ready()
        return be

    def fresh_dir(self, name: str) -> str:
        d = os.path.join(self.base, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def close(self) -> None:
        for o in self.srcs:
            o.ref_count_down()
        self.ex.shutdown(wait=True)
        self.loop.close()
        if self.own_dir:
            shutil.rmtree(self.base, ignore_errors=True)


async def _windowed(ids: Sequence[int], window: int, fn: Callable[[int], Awaitable[Any]]) -> None:
    sem = asyncio.Semaphore(window)

    async def one(i: int) -> None:
        async with sem:
            await fn(i)

    await asyncio.gather(*(one(i) for i in ids))


class Interleaved(list[float]):
    """Median seconds per file of each function (a list), plus ``paired``: the median over all
    chunks of ``time(fns[1]) / time(fns[0])`` on the same chunk, i.e. the throughput ratio of
    the first function to the second measured side by side (robust to a shared machine)."""

    paired: float | None = None


def interleaved(
    n: int,
    reps: int,
    warmup: int,
    fns: Sequence[Callable[[list[int]], float]],
    before_rep: Callable[[int], None] = lambda r: None,
    after_rep: Callable[[int], None] = lambda r: None,
) -> Interleaved:
    """Median seconds per file of each of ``fns`` over ``reps`` repetitions of ``n`` files.

    Each repetition walks the files in chunks of :data:`CHUNK` and runs every function on a chunk
    before moving to the next (alternating the order chunk by chunk), so a slow moment of a
    shared disk or CPU hits all of them alike. ``fns[k](ids)`` returns the seconds it took.
    """
    chunks = [list(range(i, min(i + CHUNK, n))) for i in range(0, n, CHUNK)]
    samples: list[list[float]] = [[] for _ in fns]
    pairs: list[float] = []
    for r in range(-warmup, reps):
        before_rep(r)
        total = [0.0] * len(fns)
        for c, ids in enumerate(chunks):
            order = range(len(fns)) if (c + r) % 2 == 0 else reversed(range(len(fns)))
            took = [0.0] * len(fns)
            for k in order:
                took[k] = fns[k](ids)
                total[k] += took[k]
            if r >= 0 and len(fns) == 2 and took[0] > 0:
                pairs.append(took[1] / took[0])
        after_rep(r)
        if r >= 0:
            for k, t in enumerate(total):
                samples[k].append(t / n)
    out = Interleaved(statistics.median(x) for x in samples)
    out.paired = statistics.median(pairs) if pairs else None
    return out


def _paired_note(res: Interleaved) -> str:
    return f"; side-by-side chunks: median ratio {res.paired:.3f}" if res.paired is not None else ""


def file_baseline_write(path: str, src: memoryview, fsync: str) -> None:
    """SPEC §6 file baseline, one whole-file job: temp name, write, fsync per policy, rename
    (as :class:`~lmcache_async_bench.common.FileBaseline` does)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb", buffering=0) as f:
        f.write(src)
        if fsync == "data":
            os.fdatasync(f.fileno())
        elif fsync == "full":
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync == "full":
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# ---- write-through --------------------------------------------------------------------------------
def bench_write(rig: _Rig, opts: BenchOptions) -> tuple[list[Result], str]:
    n, srcs = rig.n, rig.srcs
    views = [o.byte_view() for o in srcs]
    tier_dir = os.path.join(rig.base, "tier-write")
    base_dir = os.path.join(rig.base, "file-baseline")
    state: dict[str, Any] = {}

    def before(r: int) -> None:
        rig.fresh_dir("tier-write")
        rig.fresh_dir("file-baseline")
        os.sync()
        rig.round += 1
        state["keys"] = rig.keys(rig.round)
        state["be"] = rig.run(rig.open_backend(tier_dir))

    def after(r: int) -> None:
        rig.run(state.pop("be").close())

    def tier(ids: list[int]) -> float:
        be: DiskBackend = state["be"]
        keys = state["keys"]
        batches = [ids[i : i + WT_BATCH] for i in range(0, len(ids), WT_BATCH)]

        async def go() -> float:
            sem = asyncio.Semaphore(WT_INFLIGHT)

            async def batch(b: list[int]) -> None:
                async with sem:
                    res = await be.batched_put([(keys[i], srcs[i % len(srcs)]) for i in b])
                    if not all(res):
                        raise RuntimeError("disk bench: a put failed")

            t0 = time.perf_counter()
            await asyncio.gather(*(batch(b) for b in batches))
            return time.perf_counter() - t0

        return float(rig.run(go()))

    def base(ids: list[int]) -> float:
        def one(i: int) -> None:
            file_baseline_write(f"{base_dir}/{i:06d}.bin", views[i % len(views)], rig.fsync)

        t0 = time.perf_counter()
        list(rig.ex.map(one, ids))
        return time.perf_counter() - t0

    got = interleaved(n, opts.reps, opts.warmup, [tier, base], before, after)
    t_tier, t_base = got
    shutil.rmtree(base_dir, ignore_errors=True)
    res = Result(
        SUITE,
        f"write-through {n} x {rig.size >> 10} KiB (fsync={rig.fsync})",
        1 / t_tier,
        "files/s",
        baseline_name="file baseline (executor job per file, temp+rename)",
        baseline=1 / t_base,
        higher_is_better=True,
        target=0.9,
        target_kind="min",
        note=f"{WORKERS} threads each, interleaved in chunks of {CHUNK}{_paired_note(got)}",
        params={"size": rig.size, "panel": "disk tier", "series": "write-through"},
    )
    return [res], tier_dir


# ---- reads ------------------------------------------------------------------------------------------
def bench_read(rig: _Rig, opts: BenchOptions, root: str) -> list[Result]:
    keys = rig.keys(rig.round)  # the last write repetition filled ``root``
    paths = [entry_path(root, key_digest(k.to_string())) for k in keys]
    fsize = max(os.path.getsize(p) for p in paths)
    nbuf = max(8, (128 * MiB) // fsize)
    bufs = [torch.ones(fsize, dtype=torch.uint8) for _ in range(nbuf)]  # pre-touched
    views = [tensor_byte_view(b) for b in bufs]
    be: DiskBackend = rig.run(rig.open_backend(root))
    how = {"cold": ""}

    def raw_one(i: int) -> int:
        with open(paths[i], "rb", buffering=0) as f:
            n: int | None = f.readinto(views[i % nbuf])
            return n or 0

    def make(cold: bool) -> list[Callable[[list[int]], float]]:
        def raw(ids: list[int]) -> float:
            if cold:
                evict_from_page_cache([paths[i] for i in ids])
            t0 = time.perf_counter()
            got = list(rig.ex.map(raw_one, ids))
            dt = time.perf_counter() - t0
            if min(got) <= 0:
                raise RuntimeError("disk bench: a raw read came back empty")
            return dt

        def tier(ids: list[int]) -> float:
            if cold:
                evict_from_page_cache([paths[i] for i in ids])

            async def batch(b: list[int]) -> None:
                got = await be.batched_get([keys[i] for i in b])
                for obj in got:
                    if obj is None:
                        raise RuntimeError("disk bench: a get missed")
                    obj.ref_count_down()

            async def go() -> float:
                t0 = time.perf_counter()
                await asyncio.gather(*(batch(ids[i : i + WT_BATCH]) for i in range(0, len(ids), WT_BATCH)))
                return time.perf_counter() - t0

            return float(rig.run(go()))

        return [tier, raw]

    def before_cold(r: int) -> None:
        how["cold"] = drop_page_cache(paths)

    try:
        cold = interleaved(len(keys), opts.reps, opts.warmup, make(True), before_cold)
        hot = interleaved(len(keys), opts.reps, opts.warmup, make(False))
    finally:
        rig.run(be.close())
    return _read_rows(rig, len(keys), cold, hot, how["cold"])


def _read_rows(rig: _Rig, n: int, cold: Interleaved, hot: Interleaved, cold_how: str) -> list[Result]:
    """The cold and hot read rows of :func:`bench_read` (``cold_how``: how the page cache was dropped)."""
    (c_tier, c_raw), (h_tier, h_raw) = cold, hot
    common = {"size": rig.size, "panel": "disk tier"}
    return [
        Result(
            SUITE,
            f"cold read + verify {n} x {rig.size >> 10} KiB",
            1 / c_tier,
            "files/s",
            baseline_name="raw readinto of the same files",
            baseline=1 / c_raw,
            higher_is_better=True,
            target=0.8,
            target_kind="min",
            note=f"page cache dropped ({cold_how}; per chunk: fadvise){_paired_note(cold)}",
            params={**common, "series": "cold read"},
        ),
        Result(
            SUITE,
            f"hot read + verify {n} x {rig.size >> 10} KiB",
            1 / h_tier,
            "files/s",
            baseline_name="raw readinto of the same files",
            baseline=1 / h_raw,
            higher_is_better=True,
            note=f"page cache (reference){_paired_note(hot)}",
            params={**common, "series": "hot read"},
        ),
    ]


# ---- rebuild ---------------------------------------------------------------------------------------
def bench_rebuild(rig: _Rig, opts: BenchOptions, root: str) -> list[Result]:
    paths = _entry_paths(root)

    def once(cold: bool) -> float:
        if cold:
            drop_page_cache(paths)

        async def go() -> float:
            t0 = time.perf_counter()
            be = await rig.open_backend(root, ready=False)
            await be.wait_ready()
            dt = time.perf_counter() - t0
            n = be.rebuild_entries
            await be.close()
            if n != len(paths):
                raise RuntimeError(f"disk bench: rebuild found {n} of {len(paths)} entries")
            return dt

        return float(rig.run(go()))

    warm = alternate([lambda: once(False)], reps=opts.reps, warmup=opts.warmup)[0]
    cold = alternate([lambda: once(True)], reps=max(3, opts.reps // 2), warmup=0)[0]
    n = len(paths)
    return [
        Result(
            SUITE,
            f"index rebuild, {n} entries (warm)",
            n / warm,
            "entries/s",
            higher_is_better=True,
            target=None if opts.quick else 20_000,
            target_kind="min",
            note="headers in page cache" + ("; quick: the 256 shard scans dominate" if opts.quick else ""),
        ),
        Result(
            SUITE,
            f"index rebuild, {n} entries (cold)",
            n / cold,
            "entries/s",
            higher_is_better=True,
            note="page cache dropped first (reference)",
        ),
    ]


# ---- I/O style: aiofiles vs one executor job per file --------------------------------------------------
def bench_io_style(rig: _Rig, opts: BenchOptions) -> list[Result]:
    import aiofiles
    import aiofiles.os

    d = rig.fresh_dir("io-style")
    n = rig.n
    srcs = [o.byte_view() for o in rig.srcs]
    paths = {"aio": [f"{d}/a{i:06d}.bin" for i in range(n)], "job": [f"{d}/j{i:06d}.bin" for i in range(n)]}
    nbuf = max(8, (128 * MiB) // rig.size)
    tensors = [torch.ones(rig.size, dtype=torch.uint8) for _ in range(nbuf)]  # pre-touched
    bufs = [tensor_byte_view(t) for t in tensors]
    loop, ex = rig.loop, rig.ex

    def job_write(i: int) -> None:
        path = paths["job"][i]
        tmp = f"{path}.tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(srcs[i % len(srcs)])
        os.replace(tmp, path)

    def job_read(i: int) -> int:
        with open(paths["job"][i], "rb", buffering=0) as f:
            got: int | None = f.readinto(bufs[i % nbuf])
            return got or 0

    async def aio_write(i: int) -> None:
        path = paths["aio"][i]
        tmp = f"{path}.tmp"
        async with aiofiles.open(tmp, "wb", buffering=0, executor=ex) as f:
            await f.write(srcs[i % len(srcs)])
        await aiofiles.os.replace(tmp, path, executor=ex)

    async def aio_read(i: int) -> None:
        async with aiofiles.open(paths["aio"][i], "rb", buffering=0, executor=ex) as f:
            await f.readinto(bufs[i % nbuf])

    async def ex_write(i: int) -> None:
        await loop.run_in_executor(ex, job_write, i)

    async def ex_read(i: int) -> None:
        await loop.run_in_executor(ex, job_read, i)

    def timed(fn: Callable[[int], Awaitable[Any]]) -> Callable[[list[int]], float]:
        def once(ids: list[int]) -> float:
            async def go() -> float:
                t0 = time.perf_counter()
                await _windowed(ids, WT_BATCH, fn)
                return time.perf_counter() - t0

            return float(rig.run(go()))

        return once

    def clean(r: int) -> None:
        for p in (*paths["aio"], *paths["job"]):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        os.sync()

    reps, warm = opts.reps, opts.warmup
    wr = interleaved(n, reps, warm, [timed(aio_write), timed(ex_write)], clean)
    rd = interleaved(n, reps, warm, [timed(aio_read), timed(ex_read)])
    shutil.rmtree(d, ignore_errors=True)
    return _io_style_rows(rig, n, wr, rd)


def _io_style_rows(rig: _Rig, n: int, wr: Interleaved, rd: Interleaved) -> list[Result]:
    """The write and hot-read rows of :func:`bench_io_style` (aiofiles first, executor jobs second)."""
    (w_aio, w_ex), (r_aio, r_ex) = wr, rd
    note = "both from asyncio, same threads; the tier uses the faster"
    kib = rig.size >> 10
    return [
        Result(
            SUITE,
            f"aiofiles write {n} x {kib} KiB",
            1 / w_aio,
            "files/s",
            baseline_name="one executor job per file",
            baseline=1 / w_ex,
            higher_is_better=True,
            note=note + _paired_note(wr),
        ),
        Result(
            SUITE,
            f"aiofiles hot read {n} x {kib} KiB",
            1 / r_aio,
            "files/s",
            baseline_name="one executor job per file",
            baseline=1 / r_ex,
            higher_is_better=True,
            note=note + _paired_note(rd),
        ),
    ]


def run(opts: BenchOptions) -> list[Result]:
    """Every disk-tier figure (see the module docstring)."""
    rig = _Rig(opts)
    try:
        opts.say(f"disk: write-through vs file baseline ({rig.n} x {rig.size >> 10} KiB, fsync={rig.fsync})")
        out, root = bench_write(rig, opts)
        opts.say("disk: cold and hot reads vs raw readinto")
        out += bench_read(rig, opts, root)
        opts.say("disk: index rebuild")
        out += bench_rebuild(rig, opts, root)
        opts.say("disk: aiofiles vs one executor job per file")
        out += bench_io_style(rig, opts)
        return out
    finally:
        rig.close()
        os.sync()  # leave no dirty pages behind: the next suite must not pay for our writeback


if __name__ == "__main__":
    import sys

    from .common import format_table

    quick = "--quick" in sys.argv
    results = run(BenchOptions(progress=print, quick=quick))
    print(format_table(results))
    for r in results:
        if r.note:
            print(f"  {r.name}: {r.note}")
