"""Encryption at rest on the zero-copy tiers: sealed vs plain puts and gets in the same run.

* **mooncake:// tier**: the tier with ``encryption_key_file`` (each record sealed into a
  registered staging block and sent from there; each read landed in one and opened into the
  caller's buffer) vs the same tier without it (pool blocks sent and read in place), on one
  Mooncake store started on loopback, fresh prefixes each.
* **nixl tier (POSIX plugin)**: the tier with a key (each piece sealed into, or opened from, the
  worker's registered bounce area) vs without (pieces straight from/to the registered pool), in
  two directories of the same file system.

Informational (no target): what the AES-256-GCM pass and the staging copy cost on each path.
1 MiB and 16 MiB entries, ``concurrency`` (``opts.extra``, default 4) calls in flight; puts go
into an emptied tier each round (a put of a present key stores nothing); rounds alternate
sealed and plain. Without cryptography, the Mooncake wheel/binaries or NIXL, that part reports
nothing and says why. Run ``python -m lmcache_async_bench.sealed`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import statistics
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.tiers import BackendContext

from .common import BenchOptions, MiB, Result
from .remote import _alternate, _paired, _rate

__all__ = ["SUITE", "Op", "run"]

SUITE = "sealed"
Op = Callable[[int], Awaitable[None]]


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench/model", 1, 0, (i * 0x9E3779B97F4A7C15 + 7) & ((1 << 64) - 1), torch.bfloat16)


class _Rig:
    """Registered source and staging pools, a key file and a context factory."""

    def __init__(self, opts: BenchOptions, workdir: str) -> None:
        from lmcache_async.encryption import write_key_file

        self.opts = opts
        self.workdir = workdir
        self.conc = int(opts.extra.get("concurrency", 4))
        self.key_file = os.path.join(workdir, "bench.key")
        write_key_file(self.key_file)
        scale = 2 if opts.quick else 1
        self.src = PoolAllocator(160 * MiB // scale, name="bench-sealed-src")
        self.staging = PoolAllocator(512 * MiB // scale, name="bench-sealed-staging")
        for p in (self.src, self.staging):
            p.wait_ready(30)
        self.heap = HeapAllocator("bench-sealed-heap")
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-bench-sealed")

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.staging.allocate(shape, dtype, fmt) or self.heap.allocate(shape, dtype, fmt)

    def ctx(self, **cfg: Any) -> BackendContext:
        return BackendContext(
            config=LMCacheEngineConfig.from_defaults(**cfg),
            metadata=LMCacheEngineMetadata("bench/model"),
            cache_name="bench",
            loop=asyncio.get_running_loop(),
            executor=self.executor,
            staging=self.alloc,
            staging_pool=self.staging,
            pool=self.src,  # puts read from the registered pool, as the manager's CPU tier
        )

    def sources(self, nbytes: int, count: int) -> list[MemoryObj]:
        g = torch.Generator().manual_seed(nbytes)
        out = []
        for _ in range(count):
            o = self.src.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
            assert o is not None, "bench source pool exhausted"
            o.tensor.random_(0, 256, generator=g)
            out.append(o)
        return out

    def close(self) -> None:
        self.executor.shutdown(wait=True)


async def _compare(rig: _Rig, reps: int, count: int, nbytes: int, sealed: Any, plain: Any) -> dict[str, float]:
    """GB/s of put and get of ``sealed`` and ``plain`` in alternating rounds."""
    srcs = rig.sources(nbytes, count)
    try:

        def ops(be: Any) -> tuple[Op, Op]:
            async def put(i: int) -> None:
                assert await be.put(_key(i), srcs[i])

            async def get(i: int) -> None:
                obj = await be.get(_key(i))
                assert obj is not None
                obj.ref_count_down()

            return put, get

        (ps, gs), (pp, gp) = ops(sealed), ops(plain)

        def fresh(be: Any, put: Op) -> Callable[[], Awaitable[float]]:
            async def run() -> float:
                await be.clear()
                return await _rate(count, rig.conc, nbytes, put)

            return run

        def rate(op: Op) -> Callable[[], Awaitable[float]]:
            return lambda: _rate(count, rig.conc, nbytes, op)

        put_s, put_p = await _alternate(reps, [fresh(sealed, ps), fresh(plain, pp)])
        for be, put in ((sealed, ps), (plain, pp)):
            await be.clear()
            await _rate(count, rig.conc, nbytes, put)
        get_s, get_p = await _alternate(reps, [rate(gs), rate(gp)])
    finally:
        for o in srcs:
            o.ref_count_down()
    med = statistics.median
    return {"put_a": med(put_s), "put_b": med(put_p), "get_a": med(get_s), "get_b": med(get_p),
            "put_paired": _paired(put_s, put_p), "get_paired": _paired(get_s, get_p)}  # fmt: skip


def _results(tier: str, nbytes: int, r: dict[str, float]) -> list[Result]:
    return [
        Result(
            SUITE,
            f"{nbytes // MiB} MiB {tier} tier sealed {op}",
            r[f"{op}_a"],
            "GB/s",
            f"{tier} tier plain {op}",
            r[f"{op}_b"],
            higher_is_better=True,
            note=f"median of paired rounds {r[op + '_paired']:.3f}",
            params={"size": nbytes, "panel": f"{tier} tier, sealed vs plain", "series": op},
        )
        for op in ("put", "get")
    ]


def _sizes(opts: BenchOptions) -> list[tuple[int, int]]:
    return [(MiB, 16 if opts.quick else 32), (16 * MiB, 4 if opts.quick else 8)]


async def _mooncake(rig: _Rig, reps: int) -> list[Result]:
    from lmcache_async.remote.mooncake import MooncakeBackend
    from lmcache_async.testing.servers import MooncakeServers, mooncake_binaries

    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        rig.opts.say(f"sealed: mooncake part skipped ({exc})")
        return []
    if mooncake_binaries() is None:
        rig.opts.say("sealed: mooncake part skipped (no mooncake_master/mooncake_client binaries)")
        return []
    out: list[Result] = []
    with MooncakeServers(segment_bytes=1024 * MiB, lease_ttl_ms=10_000) as srv:
        rig.opts.say(f"sealed: started {srv!r}")
        sealed = MooncakeBackend(rig.ctx(**srv.config(), encryption_key_file=rig.key_file), prefix="bench-sealed",
                                 timeout_s=60.0, workers=4)  # fmt: skip
        plain = MooncakeBackend(rig.ctx(**srv.config()), prefix="bench-plain", timeout_s=60.0, workers=4)
        for be in (sealed, plain):
            await be.start()
        try:
            for nbytes, count in _sizes(rig.opts):
                rig.opts.say(f"sealed: mooncake, {nbytes // MiB} MiB entries x {count}, concurrency {rig.conc}")
                out += _results("mooncake", nbytes, await _compare(rig, reps, count, nbytes, sealed, plain))
        finally:
            for be in (sealed, plain):
                await be.clear()
                await be.close()
    return out


async def _nixl(rig: _Rig, reps: int) -> list[Result]:
    from lmcache_async.encryption import load_cipher
    from lmcache_async.nixl.tier import NixlBackend, NixlSettings, nixl_available

    if not nixl_available():
        rig.opts.say("sealed: nixl part skipped (NIXL is not importable)")
        return []
    out: list[Result] = []
    made = []
    for sub, cipher in (("sealed", load_cipher(rig.key_file)), ("plain", None)):
        settings = NixlSettings(plugin="POSIX", path=os.path.join(rig.workdir, f"nixl-{sub}"), max_bytes=4 << 30)
        made.append(NixlBackend(rig.ctx(), settings, cipher=cipher))
    for be in made:
        await be.start()
    try:
        for nbytes, count in _sizes(rig.opts):
            rig.opts.say(f"sealed: nixl POSIX, {nbytes // MiB} MiB entries x {count}, concurrency {rig.conc}")
            out += _results("nixl", nbytes, await _compare(rig, reps, count, nbytes, made[0], made[1]))
    finally:
        for be in made:
            await be.clear()
            await be.close()
    return out


async def _run(opts: BenchOptions, workdir: str) -> list[Result]:
    rig = _Rig(opts, workdir)
    reps = max(opts.reps, 3) if opts.quick else 2 * max(opts.reps, 5) + 1
    try:
        return await _mooncake(rig, reps) + await _nixl(rig, reps)
    finally:
        rig.close()


def run(opts: BenchOptions) -> list[Result]:
    """Every figure of the suite (see the module docstring); none, with a line saying why,
    without cryptography."""
    try:
        import cryptography  # noqa: F401
    except ImportError as exc:
        opts.say(f"sealed skipped: {exc} (pip install lmcache-async[encryption])")
        return []
    with tempfile.TemporaryDirectory(prefix="lmcache-async-bench-sealed-", dir=opts.workdir) as workdir:
        return asyncio.run(_run(opts, workdir))


if __name__ == "__main__":
    import sys

    from .common import format_table

    quick = "--quick" in sys.argv
    print(format_table(run(BenchOptions(progress=print, quick=quick))))
