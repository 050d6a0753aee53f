"""Which I/O style for large records: aiofiles against one blocking executor job per file.

aiofiles makes one thread hop per call (open, each write or read, close); that loses on small
files (the ``disk`` suite's io-style figures). Here the hops are amortized over large records
moved in pieces, the case where aiofiles could win:

* **write in pieces**: a record of ``size`` bytes written as ``piece``-byte writes to a
  temporary name, then renamed — aiofiles (a hop per call) vs one executor job doing the same
  blocking calls (the disk tier's and ``fs://``'s style today);
* **read in pieces**: the same files read back into pre-touched buffers, piece by piece;
* **verify streaming** (``lmcache-async inspect --verify``): each file read in 4 MiB chunks and
  hashed with xxh3 — aiofiles reads with the hash on the loop vs one executor job per file
  reading and hashing (the tool's blocking loop, moved off the loop).

Both styles run from one asyncio loop on the same executor (4 threads), ``concurrency`` files in
flight, alternating rounds; reads are hot (page cache). Run alone:
``python -m lmcache_async_bench.io_style [--quick]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import xxhash

from .common import BenchOptions, MiB, Result, median_of

__all__ = ["SUITE", "VERIFY_CHUNK", "WORKERS", "run"]

SUITE = "io_style"
WORKERS = 4
VERIFY_CHUNK = 4 * MiB


def _views(t: torch.Tensor) -> memoryview:
    return t.numpy().data.cast("B")  # the view keeps the array (and the tensor) alive


class _Rig:
    """Files, sources and pre-touched read buffers for one (size, piece) case."""

    def __init__(self, root: str, n: int, size: int, piece: int) -> None:
        self.root, self.n, self.size, self.piece = root, n, size, piece
        g = torch.Generator().manual_seed(size)
        self.src = _views(torch.randint(0, 255, (size,), dtype=torch.uint8, generator=g))
        self.bufs = [_views(torch.ones(size, dtype=torch.uint8)) for _ in range(4)]
        self.paths = {s: [os.path.join(root, f"{s}{i:04d}.rec") for i in range(n)] for s in ("aio", "job")}

    # ---- blocking pieces (run inside one executor job) -------------------------------------
    def job_write(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb", buffering=0) as f:
            for off in range(0, self.size, self.piece):
                f.write(self.src[off : off + self.piece])
        os.replace(tmp, path)

    def job_read(self, path: str, slot: int) -> int:
        buf, got = self.bufs[slot % len(self.bufs)], 0
        with open(path, "rb", buffering=0) as f:
            while got < self.size:
                n = f.readinto(buf[got : got + self.piece])
                if not n:
                    break
                got += n
        return got

    @staticmethod
    def job_verify(path: str) -> int:
        h = xxhash.xxh3_64()
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(VERIFY_CHUNK):
                h.update(chunk)
        return h.intdigest()

    # ---- aiofiles pieces (a hop per call) ----------------------------------------------------
    async def aio_write(self, path: str, ex: concurrent.futures.Executor) -> None:
        import aiofiles
        import aiofiles.os

        tmp = path + ".tmp"
        async with aiofiles.open(tmp, "wb", buffering=0, executor=ex) as f:
            for off in range(0, self.size, self.piece):
                await f.write(self.src[off : off + self.piece])
        await aiofiles.os.replace(tmp, path, executor=ex)

    async def aio_read(self, path: str, slot: int, ex: concurrent.futures.Executor) -> int:
        import aiofiles

        buf, got = self.bufs[slot % len(self.bufs)], 0
        async with aiofiles.open(path, "rb", buffering=0, executor=ex) as f:
            while got < self.size:
                n = await f.readinto(buf[got : got + self.piece])
                if not n:
                    break
                got += n
        return got

    @staticmethod
    async def aio_verify(path: str, ex: concurrent.futures.Executor) -> int:
        import aiofiles

        h = xxhash.xxh3_64()
        async with aiofiles.open(path, "rb", buffering=0, executor=ex) as f:
            while chunk := await f.read(VERIFY_CHUNK):
                h.update(chunk)
        return h.intdigest()


async def _windowed(n: int, concurrency: int, fn: Callable[[int], Awaitable[Any]]) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await fn(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


def _case(opts: BenchOptions, root: str, n: int, size: int, piece: int, concurrency: int) -> list[Result]:
    rig = _Rig(root, n, size, piece)
    ex = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="lmcache-async-bench-io")
    loop = asyncio.new_event_loop()
    try:
        styles: dict[str, dict[str, Callable[[int], Awaitable[Any]]]] = {
            "aio": {
                "write": lambda i: rig.aio_write(rig.paths["aio"][i], ex),
                "read": lambda i: rig.aio_read(rig.paths["aio"][i], i, ex),
                "verify": lambda i: rig.aio_verify(rig.paths["aio"][i], ex),
            },
            "job": {
                "write": lambda i: loop.run_in_executor(ex, rig.job_write, rig.paths["job"][i]),
                "read": lambda i: loop.run_in_executor(ex, rig.job_read, rig.paths["job"][i], i),
                "verify": lambda i: loop.run_in_executor(ex, rig.job_verify, rig.paths["job"][i]),
            },
        }
        samples: dict[tuple[str, str], list[float]] = {}
        for rep in range(opts.warmup + opts.reps):
            for op in ("write", "read", "verify"):
                order = ("aio", "job") if rep % 2 == 0 else ("job", "aio")  # alternate who goes first
                for style in order:
                    secs = loop.run_until_complete(_windowed(n, concurrency, styles[style][op]))
                    if rep >= opts.warmup:
                        samples.setdefault((style, op), []).append(secs)
        gib = n * size / (1 << 30)
        out = []
        label = f"{n} x {size // MiB} MiB in {piece // MiB} MiB pieces, concurrency {concurrency}"
        for op, what in (("write", "write"), ("read", "hot read"), ("verify", "verify (read + xxh3)")):
            aio, job = median_of(samples[("aio", op)]), median_of(samples[("job", op)])
            out.append(
                Result(
                    SUITE, f"aiofiles {what}, {label}", gib / aio, "GiB/s",
                    baseline_name="one executor job per file", baseline=gib / job, higher_is_better=True,
                    note="same loop, same 4-thread executor; alternating rounds",
                    params={
                        "n": n, "size": size, "piece": piece, "concurrency": concurrency,
                        "series": f"aiofiles {what}",
                        "panel": f"io_style: concurrent files ({n} x {size // MiB} MiB, {piece // MiB} MiB pieces)",
                    },
                )
            )  # fmt: skip
        return out
    finally:
        loop.close()
        ex.shutdown(wait=True)
        for paths in rig.paths.values():
            for p in paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


def run(opts: BenchOptions) -> list[Result]:
    """Every io-style figure (see the module docstring)."""
    root = tempfile.mkdtemp(prefix="lmcache-async-bench-io-", dir=opts.workdir)
    cases = [(8, 4 * MiB, 1 * MiB, 1), (8, 4 * MiB, 1 * MiB, 4)] if opts.quick else [
        (32, 4 * MiB, 1 * MiB, 1), (32, 4 * MiB, 1 * MiB, 4), (16, 16 * MiB, 4 * MiB, 1), (16, 16 * MiB, 4 * MiB, 4),
    ]  # fmt: skip
    out: list[Result] = []
    try:
        for n, size, piece, conc in cases:
            opts.say(f"io_style: {n} x {size // MiB} MiB, {piece // MiB} MiB pieces, concurrency {conc}")
            out += _case(opts, root, n, size, piece, conc)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    import sys

    from .common import format_table

    results = run(BenchOptions(progress=print, quick="--quick" in sys.argv))
    print(format_table(results))
