"""Throughput vs entry size, per tier, each point beside its physical baseline (the ``--plot``
figure: one panel per tier, put and get against entry size, baselines dashed).

For each tier and entry size (64 KiB ... 16 MiB; ``quick``: 64 KiB, 1 MiB, 4 MiB) the suite
measures, through a :class:`~lmcache_async.storage_manager.StorageManager` built for that tier:

* **put**: ``put_sync`` of a fresh key; for the lower tiers followed by ``flush_sync``, so the
  entry is on the tier when the figure's clock stops;
* **get**: ``get_sync`` of an entry only that tier holds (the lower tiers' managers have no
  CPU tier, so every get goes down); for the CPU tier, whose ``get_sync`` hands out a reference
  without copying, the figure adds the copy a consumer makes into its own buffer.

One operation is in flight at a time, and so is each baseline's:

* **cpu** — ``copy_`` from rotating sources into pre-touched destinations rotating over 256 MiB
  (:class:`~lmcache_async_bench.common.CopyBaseline`); the pool rotates over 256 MiB too
  (steady state: every put evicts the oldest entry);
* **disk** — the file baseline: one executor job per whole file (temp name + rename; reads with
  ``readinto`` into pre-touched buffers), each awaited before the next; reads come from the page
  cache (the files were just written; the ``disk`` suite measures cold reads);
* **remote** — raw ``redis.asyncio`` SET/GET of the same bytes on the same server (a
  ``redis-server`` the suite starts unless ``opts.redis_url`` names one);
* **nixl** — bare NIXL POSIX transfers of the same bytes (the ``nixl`` suite's baseline: writes
  to new files, reads of registered files); the tier is skipped when NIXL is not installed.

Every round of a point writes a bounded amount (``opts.extra["round_mib"]``, default 32 MiB;
16 in quick mode, and at least 4 entries); the lower tiers are cleared before each put round,
so the puts go to an empty tier like the baseline's go to new files. The tier and its baseline
run interleaved round by round (:func:`~lmcache_async_bench.common.alternate`). The figures are
informational (no targets). ``opts.extra``: ``sizes`` (bytes), ``tiers`` (subset of
:data:`TIERS`), ``round_mib``.

Run ``python -m lmcache_async_bench.sweep [--quick] [--plot FILE]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, tensor_byte_view
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager

from .common import BenchOptions, CopyBaseline, MiB, Result, alternate, with_redis

__all__ = [
    "QUICK_SIZES",
    "SIZES",
    "SUITE",
    "TIERS",
    "Point",
    "Round",
    "main",
    "run",
    "size_label",
    "sweep_cpu",
    "sweep_disk",
    "sweep_nixl",
    "sweep_remote",
]

SUITE = "sweep"
KiB = 1 << 10
SIZES = (64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB)
QUICK_SIZES = (64 * KiB, MiB, 4 * MiB)
TIERS = ("cpu", "disk", "remote", "nixl")
MIN_ENTRIES = 4
MAX_ENTRIES = 256
SOURCE_SPAN = 64 * MiB  # distinct source bytes per point (sources rotate beyond that)
Round = Callable[[], float]  # one repetition; returns seconds per entry

_hashes = itertools.count(1)


def size_label(nbytes: int) -> str:
    """``64 KiB``, ``1 MiB``, ..."""
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _fresh_keys(n: int) -> list[CacheEngineKey]:
    return [
        CacheEngineKey("bench/sweep", 1, 0, (next(_hashes) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1), torch.float32)
        for _ in range(n)
    ]


def _entries(nbytes: int, round_bytes: int) -> int:
    """Entries per round: about ``round_bytes``, at least :data:`MIN_ENTRIES`."""
    return max(MIN_ENTRIES, min(MAX_ENTRIES, round_bytes // nbytes))


def _sources(nbytes: int, n: int) -> list[torch.Tensor]:
    """Random float32 payloads of ``nbytes`` (at most :data:`SOURCE_SPAN` of them in all)."""
    g = torch.Generator().manual_seed(nbytes)
    count = max(1, min(n, SOURCE_SPAN // nbytes))
    return [torch.randn(nbytes // 4, generator=g) for _ in range(count)]


def _per_entry(n: int, fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n


def _manager(name: str, **cfg: Any) -> StorageManager:
    config = LMCacheEngineConfig.from_defaults(**cfg)
    sm = StorageManager(config, LMCacheEngineMetadata("bench/sweep"), name=name)
    for pool in (sm.pool, sm.staging_pool):
        if pool is not None:
            pool.wait_ready(60)
    return sm


def _lower_manager(tier: str, **cfg: Any) -> StorageManager:
    """A manager whose only tier is ``tier`` (no CPU tier: every get goes down to it)."""
    sm = _manager(f"sweep-{tier}", local_cpu=False, staging_size=0.25, tier_order=[tier], **cfg)
    if sm.tier_names != [tier]:
        sm.close_sync()
        raise BackendUnavailableError(f"the {tier} tier was not built (tiers: {sm.tier_names})")
    return sm


def _check(ok: bool, what: str, sm: StorageManager) -> None:
    if not ok:
        raise RuntimeError(f"sweep: {what} failed: {sm.stats()}")


class _LowerTierRounds:
    """Timed put/get rounds of one entry size through a manager with one lower tier.

    ``put``: clear the tier (untimed), then ``put_sync`` + ``flush_sync`` per fresh key; ``get``:
    ``get_sync`` of the last put round's keys, each released at once.
    """

    def __init__(self, sm: StorageManager, srcs: Sequence[torch.Tensor | MemoryObj], n: int) -> None:
        self.sm = sm
        self.srcs = srcs
        self.n = n
        self.keys: list[CacheEngineKey] = []

    def put(self) -> float:
        sm, srcs = self.sm, self.srcs
        sm.clear_sync()
        keys = self.keys = _fresh_keys(self.n)

        def go() -> None:
            for i, k in enumerate(keys):
                ok = sm.put_sync(k, srcs[i % len(srcs)])
                sm.flush_sync()
                _check(ok, "put_sync", sm)

        t = _per_entry(self.n, go)
        _check(all(t_["write_failures"] == 0 for t_ in self._tiers()), "write-through", sm)
        return t

    def get(self) -> float:
        sm, keys = self.sm, self.keys

        def go() -> None:
            for k in keys:
                obj = sm.get_sync(k)
                _check(obj is not None, "get_sync (a miss)", sm)
                assert obj is not None
                obj.ref_count_down()

        return _per_entry(self.n, go)

    def _tiers(self) -> list[dict[str, Any]]:
        return [v for k, v in self.sm.stats().get("tiers", {}).items() if k != "cpu"]


def _results(
    tier: str,
    nbytes: int,
    n: int,
    times: Sequence[float],
    base_names: tuple[str, str],
    note: str,
) -> list[Result]:
    """put and get Results from ``(tier put, baseline put, tier get, baseline get)`` seconds."""
    tp, bp, tg, bg = times
    out = []
    for op, t, b, base in (("put", tp, bp, base_names[0]), ("get", tg, bg, base_names[1])):
        out.append(
            Result(
                SUITE,
                f"{tier} {op} {size_label(nbytes)}",
                nbytes / t / 1e9,
                "GB/s",
                base,
                nbytes / b / 1e9,
                higher_is_better=True,
                note=f"{n} entries per round, one at a time; {note}",
                params={
                    "size": nbytes,
                    "panel": f"sweep: {tier} tier",
                    "series": op,
                    "tier": tier,
                    "entries_per_round": n,
                },
            )
        )
    return out


def _measure(opts: BenchOptions, fns: Sequence[Round]) -> list[float]:
    return alternate(fns, reps=max(opts.reps, 1), warmup=max(opts.warmup, 1))


Point = Callable[[int, int], Sequence[float]]
"""``point(nbytes, n)``: seconds per entry of (tier put, baseline put, tier get, baseline get)."""


def _sweep_points(
    opts: BenchOptions,
    tier: str,
    sizes: Sequence[int],
    entries: Callable[[int], int],
    point: Point,
    base_names: tuple[str, str],
    note: str,
) -> list[Result]:
    """Every size's put/get Results of ``tier`` (``entries(nbytes)`` entries per round)."""
    out: list[Result] = []
    for nbytes in sizes:
        n = entries(nbytes)
        opts.say(f"sweep: {tier} tier, {size_label(nbytes)} x {n}")
        out += _results(tier, nbytes, n, point(nbytes, n), base_names, note)
    return out


class _Baseline(Protocol):
    def put(self) -> float: ...
    def get(self) -> float: ...
    def close(self) -> None: ...


def _against(opts: BenchOptions, sm: StorageManager, baseline: Callable[[list[torch.Tensor], int], _Baseline]) -> Point:
    """A point measuring ``sm``'s one lower tier beside ``baseline(sources, n)`` on the same
    bytes; the tier is cleared and the baseline closed after each point."""

    def point(nbytes: int, n: int) -> list[float]:
        srcs = _sources(nbytes, n)
        tier = _LowerTierRounds(sm, srcs, n)
        base = baseline(srcs, n)
        try:
            return _measure(opts, [tier.put, base.put, tier.get, base.get])
        finally:
            sm.clear_sync()
            base.close()

    return point


# ---- cpu --------------------------------------------------------------------------------------
CPU_SPAN = 256 * MiB  # the pool and the copy baseline's destinations both rotate over this


def _cpu_point(opts: BenchOptions, sm: StorageManager, nbytes: int, n: int) -> list[float]:
    base = CopyBaseline(nbytes, span=CPU_SPAN)
    srcs, dsts = base.src, base.dst
    keys: list[CacheEngineKey] = []
    next_dst = 0

    def tier_put() -> float:
        keys[:] = _fresh_keys(n)

        def go() -> None:
            for i, k in enumerate(keys):
                _check(sm.put_sync(k, srcs[i % len(srcs)]), "put_sync", sm)

        return _per_entry(n, go)

    def tier_get() -> float:
        nonlocal next_dst
        j = next_dst
        next_dst += n

        def go() -> None:
            for i, k in enumerate(keys):
                obj = sm.get_sync(k)
                _check(obj is not None, "get_sync (a miss)", sm)
                assert obj is not None
                dsts[(j + i) % len(dsts)].copy_(obj.tensor)
                obj.ref_count_down()

        return _per_entry(n, go)

    def copy_round() -> float:
        def go() -> None:
            for _ in range(n):
                base.step()

        return _per_entry(n, go)

    try:
        return _measure(opts, [tier_put, copy_round, tier_get, copy_round])
    finally:
        sm.clear_sync()


def sweep_cpu(opts: BenchOptions, sizes: Sequence[int], round_bytes: int) -> list[Result]:
    sm = _manager("sweep-cpu", max_local_cpu_size=CPU_SPAN / (1 << 30), staging_size=0)
    try:
        return _sweep_points(
            opts,
            "cpu",
            sizes,
            lambda nbytes: _entries(nbytes, 2 * round_bytes),  # no I/O: twice the entries, steadier
            lambda nbytes, n: _cpu_point(opts, sm, nbytes, n),
            ("copy_ (rotating)", "copy_ (rotating)"),
            "get = get_sync + copy_ into the consumer's buffer (get_sync itself copies nothing)",
        )
    finally:
        sm.close_sync()


# ---- disk -------------------------------------------------------------------------------------
class _FileRounds:
    """The file baseline at one operation in flight: one executor job per whole file (temp name
    + rename; reads ``readinto`` a pre-touched buffer), each awaited before the next."""

    def __init__(self, directory: str, srcs: Sequence[torch.Tensor], n: int, executor: Any) -> None:
        from .disk import file_baseline_write

        self._write = file_baseline_write
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.n = n
        self.views = [tensor_byte_view(t) for t in srcs]
        nbytes = srcs[0].numel() * srcs[0].element_size()
        self.bufs = [torch.ones(nbytes, dtype=torch.uint8) for _ in range(max(4, min(n, 128 * MiB // nbytes)))]
        self.buf_views = [tensor_byte_view(b) for b in self.bufs]
        self.paths = [os.path.join(directory, f"{i:06d}.bin") for i in range(n)]
        self.ex = executor
        self.nbytes = nbytes

    def _unlink_all(self) -> None:
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def _read_one(self, i: int) -> int:
        with open(self.paths[i], "rb", buffering=0) as f:
            got: int | None = f.readinto(self.buf_views[i % len(self.buf_views)])
            return got or 0

    def put(self) -> float:
        self._unlink_all()  # like the tier's clear: every round writes new files
        ex, views, paths = self.ex, self.views, self.paths

        def go() -> None:
            for i, p in enumerate(paths):
                ex.submit(self._write, p, views[i % len(views)], "none").result()

        return _per_entry(self.n, go)

    def get(self) -> float:
        ex = self.ex

        def go() -> None:
            for i in range(self.n):
                if ex.submit(self._read_one, i).result() != self.nbytes:
                    raise RuntimeError("sweep: file baseline short read")

        return _per_entry(self.n, go)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def sweep_disk(opts: BenchOptions, sizes: Sequence[int], round_bytes: int, workdir: str) -> list[Result]:
    tier_dir = os.path.join(workdir, "disk-tier")
    sm = _lower_manager("disk", local_disk=tier_dir, max_local_disk_size=1.0, local_disk_fsync="none")
    ex = concurrent.futures.ThreadPoolExecutor(sm.config.executor_workers, thread_name_prefix="lmcache-async-bench-io")
    base_dir = os.path.join(workdir, "file-baseline")
    try:
        return _sweep_points(
            opts,
            "disk",
            sizes,
            lambda nbytes: _entries(nbytes, round_bytes),
            _against(opts, sm, lambda srcs, n: _FileRounds(base_dir, srcs, n, ex)),
            ("file write (temp+rename)", "file readinto"),
            "fsync none; reads from the page cache",
        )
    finally:
        sm.close_sync()
        ex.shutdown(wait=True)


# ---- remote -----------------------------------------------------------------------------------
class _RawRedisRounds:
    """Raw ``redis.asyncio`` SET/GET of the same bytes, one at a time, on a loop of its own."""

    def __init__(self, url: str, srcs: Sequence[torch.Tensor], n: int, prefix: str) -> None:
        import redis.asyncio as aredis

        self.loop = asyncio.new_event_loop()
        self.client = aredis.Redis.from_url(url)
        self.views = [tensor_byte_view(t) for t in srcs]
        self.names = [f"{prefix}:{i}" for i in range(n)]
        self.n = n

    def put(self) -> float:
        client, views, names = self.client, self.views, self.names
        self.loop.run_until_complete(client.delete(*names))  # like the tier's clear

        async def go() -> None:
            for i, name in enumerate(names):
                await client.set(name, views[i % len(views)])

        return _per_entry(self.n, lambda: self.loop.run_until_complete(go()))

    def get(self) -> float:
        client, names = self.client, self.names

        async def go() -> None:
            for name in names:
                if await client.get(name) is None:
                    raise RuntimeError("sweep: raw GET missed")

        return _per_entry(self.n, lambda: self.loop.run_until_complete(go()))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.delete(*self.names))
            self.loop.run_until_complete(self.client.aclose())
        finally:
            self.loop.close()


def sweep_remote(opts: BenchOptions, sizes: Sequence[int], round_bytes: int, url: str) -> list[Result]:
    prefix = f"lmcache-async-sweep-{uuid.uuid4().hex[:8]}"
    sm = _lower_manager("remote", remote_url=url, remote_key_prefix=prefix, remote_timeout_s=30.0)
    try:
        return _sweep_points(
            opts,
            "remote",
            sizes,
            lambda nbytes: _entries(nbytes, round_bytes),
            _against(opts, sm, lambda srcs, n: _RawRedisRounds(url, srcs, n, f"{prefix}-raw")),
            ("raw SET", "raw GET"),
            f"one connection each; tier parts of {sm.config.remote_part_size >> 10} KiB",
        )
    finally:
        sm.close_sync()


# ---- nixl -------------------------------------------------------------------------------------
def _nixl_point(opts: BenchOptions, sm: StorageManager, nbytes: int, n: int, workdir: Path) -> list[float]:
    from .nixl import _Bare, _Fixture

    fx = _Fixture(nbytes, n, workdir)
    try:
        bare = _Bare(fx)
        try:
            tier = _LowerTierRounds(sm, fx.srcs, n)

            def bare_write() -> float:
                return bare.write_fresh() / n

            def bare_read() -> float:
                return _per_entry(n, bare.read)

            return _measure(opts, [tier.put, bare_write, tier.get, bare_read])
        finally:
            sm.clear_sync()
            bare.close()
    finally:
        fx.close()
        shutil.rmtree(workdir, ignore_errors=True)


def sweep_nixl(opts: BenchOptions, sizes: Sequence[int], round_bytes: int, workdir: str) -> list[Result]:
    sm = _lower_manager(
        "nixl",
        nixl_path=os.path.join(workdir, "nixl-tier"),
        nixl_max_size=1.0,
        nixl_backend="POSIX",
        remote_timeout_s=30.0,
    )
    try:
        return _sweep_points(
            opts,
            "nixl",
            sizes,
            lambda nbytes: _entries(nbytes, round_bytes),
            lambda nbytes, n: _nixl_point(opts, sm, nbytes, n, Path(workdir) / "nixl-bare"),
            ("bare NIXL write (new files)", "bare NIXL read"),
            "POSIX plugin, one file per entry",
        )
    finally:
        sm.close_sync()


# ---- the suite --------------------------------------------------------------------------------
def _nixl_missing() -> str | None:
    """Why the NIXL tier cannot run here, or None."""
    try:
        from lmcache_async.nixl.agent import load_nixl

        load_nixl()
    except (BackendUnavailableError, ImportError) as exc:
        return str(exc).split(";")[0]
    return None


def _remote(opts: BenchOptions, sizes: Sequence[int], round_bytes: int) -> list[Result]:
    return with_redis(opts, "sweep: remote tier", lambda url: sweep_remote(opts, sizes, round_bytes, url))


def run(opts: BenchOptions) -> list[Result]:
    """Put/get throughput vs entry size for every available tier (see the module docstring)."""
    sizes = [int(s) for s in opts.extra.get("sizes", QUICK_SIZES if opts.quick else SIZES)]
    tiers = [str(t) for t in opts.extra.get("tiers", TIERS)]
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        raise ValueError(f"opts.extra['tiers'] has unknown tiers {unknown}; known: {list(TIERS)}")
    round_bytes = int(float(opts.extra.get("round_mib", 16 if opts.quick else 32)) * MiB)
    own = opts.workdir is None
    top = opts.workdir or tempfile.mkdtemp(prefix="lmcache-async-bench-sweep-")
    os.makedirs(top, exist_ok=True)
    work = tempfile.mkdtemp(prefix="sweep-", dir=top)
    out: list[Result] = []
    try:
        if "cpu" in tiers:
            out += sweep_cpu(opts, sizes, round_bytes)
        if "disk" in tiers:
            out += sweep_disk(opts, sizes, round_bytes, work)
        if "remote" in tiers:
            out += _remote(opts, sizes, round_bytes)
        if "nixl" in tiers:
            why = _nixl_missing()
            if why is None:
                out += sweep_nixl(opts, sizes, round_bytes, work)
            else:
                opts.say(f"sweep: nixl tier skipped: {why}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own:
            shutil.rmtree(top, ignore_errors=True)
        os.sync()  # leave no dirty pages behind: the next suite must not pay for our writeback
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    from .common import format_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="three sizes, fewer entries (smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="directory for the files (default: a temp dir)")
    ap.add_argument("--redis-url", default=None, help="a running server (default: start one)")
    ap.add_argument("--tier", action="append", choices=TIERS, help="tier to measure (repeatable; default all)")
    ap.add_argument("--plot", default=None, help="write the PNG figure here (needs matplotlib)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    extra: dict[str, Any] = {"tiers": args.tier} if args.tier else {}
    opts = BenchOptions(
        reps=max(args.reps, 1),
        quick=args.quick,
        workdir=args.workdir,
        redis_url=args.redis_url,
        progress=lambda m: print(f"[{time.monotonic() - start:6.1f}s] {m}", flush=True),
        extra=extra,
    )
    results = run(opts)
    print(format_table(results))
    if args.plot:
        from .plot import plot_results

        plot_results(results, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
