"""Node cache server figures, measured from a client process against same-run baselines.

The suite starts ``lmcache-async serve`` and a bare Unix-socket echo server (the same event loop
for both: uvloop when installed, else asyncio; ``LMCACHE_ASYNC_SERVER_LOOP`` picks one) as child
processes; this process is the client.

* **contains** of one key vs one echo round trip of a same-sized message; target <= 1.5x;
* **1 MiB get, copied out** (copy from the mapped pool into a pre-touched staging block) vs an
  echo round trip plus the same copy: a single-threaded ``memmove`` of 1 MiB from a shared memfd
  mapping (4 KiB pages, as the client's view of the pool) into a block taken from (and returned
  to) the same staging pool, as the client does; target <= 1.5x. Two rows: the default client,
  which copies an entry it read before from the location it remembers (no round trip, checked
  by the pool's version table), and a client that asks every time (``remember_locations=False``:
  one lease-free READ round trip, then the copy);
* **1 MiB get_view** (zero copy: lease, read the view, release) vs one echo round trip, for
  reference (the release is one more frame the server wakes for);
* **1 MiB get vs an in-process EC get** (``ECCacheEngine.get``, which also copies into a fresh
  tensor), each side reading ``EC_ENTRIES`` distinct entries in turn: throughput ratio; target
  >= 0.7 for the default client; the asking client's row is for reference;
* **1 MiB put and get vs the Redis tier** on loopback (``RemoteBackend`` on a ``redis-server``
  started for the run, one at a time): throughput ratios; target >= 3 (skipped without a
  redis/valkey binary; :mod:`lmcache_async_bench.server_redis`).

All processes run on one CPU (see ``_one_cpu``). Rounds alternate figure and baseline so
background noise hits both; each figure is the median of
``reps`` rounds, and each round's figure the median of its calls, each timed alone. Run
``python -m lmcache_async_bench.server [--quick]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.server.client import ServerClient, query_status

from .common import BenchOptions, MiB, Result, alternate, with_redis

__all__ = ["EC_ENTRIES", "SUITE", "run"]

SUITE = "server"

_ECHO = r"""
import asyncio, os, sys
async def handle(r, w):
    try:
        while True:
            data = await r.read(1 << 20)
            if not data:
                break
            w.write(data)
            await w.drain()
    except ConnectionError:
        pass
    finally:
        w.close()
async def main(path):
    srv = await asyncio.start_unix_server(handle, path)
    async with srv:
        await srv.serve_forever()
from lmcache_async.server.server import LOOP_ENV, event_loop_factory
with asyncio.Runner(loop_factory=event_loop_factory(os.environ.get(LOOP_ENV, "auto"))) as runner:
    runner.run(main(sys.argv[1]))
"""


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench/server", 1, 0, (i * 0x9E3779B97F4A7C15 + 11) & ((1 << 64) - 1), torch.bfloat16)


def _kb(i: int) -> bytes:
    return _key(i).to_string().encode()


def _wait_socket(path: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"child exited with {proc.returncode}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise RuntimeError(f"nothing listens on {path}")


class _Echo:
    """A blocking client of the echo server: one round trip of ``nbytes``."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.msg = os.urandom(nbytes)
        self.buf = bytearray(nbytes)

    def round_trip(self) -> None:
        self.sock.sendall(self.msg)
        view = memoryview(self.buf)
        got = 0
        while got < len(self.buf):
            got += self.sock.recv_into(view[got:])


class _SameCopy:
    """The copy a get does, alone: take a 1 MiB block from the caller's staging pool, ``memmove``
    1 MiB into it from a shared file mapping of the same kind as the client's view of the pool
    (a memfd mapped ``MAP_SHARED | MAP_POPULATE``), give the block back."""

    def __init__(self, staging: PoolAllocator) -> None:
        self.staging = staging
        fd = os.memfd_create("bench-copy-src", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 4 * MiB)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, 4 * MiB, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.src = torch.frombuffer(self._mm, dtype=torch.uint8, offset=MiB, count=MiB)
        self.src.copy_(torch.randint(0, 255, (MiB,), dtype=torch.uint8))

    def step(self) -> None:
        dst = self.staging.allocate((256, 1024), torch.float32, MemoryFormat.EC_TD)
        assert dst is not None
        ctypes.memmove(dst.tensor.data_ptr(), self.src.data_ptr(), MiB)
        dst.ref_count_down()


def _per_op(fn: Callable[[], object], inner: int) -> Callable[[], float]:
    """One round: ``inner`` calls, each timed alone; the round's figure is their median, so a
    call that the scheduler of a busy machine preempted for milliseconds does not set the
    round's figure (figure and baseline are measured alike)."""

    def one() -> float:
        times = []
        clock = time.perf_counter
        for _ in range(inner):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return statistics.median(times)

    return one


def _warm_up(client: ServerClient, pool_gib: float) -> None:
    """Fill the namespace's pool once with 1 MiB entries, then remove them: the server has then
    committed the whole pool (no growth step runs during the figures) and this client has
    touched every page of its mapping (the first-touch cost is measured on its own)."""
    pool = PoolAllocator(2 * MiB, name="bench-warm", pretouch=False)
    src = pool.allocate((256, 1024), torch.float32, MemoryFormat.EC_TD)
    assert src is not None
    keys = [_kb(500_000 + i) for i in range(int(pool_gib * 1024))]
    for k in keys:
        client.put([(k, src)])
    client.remove(keys)
    src.ref_count_down()


def _first_touch(opts: BenchOptions, sock: str) -> list[Result]:
    """What a fresh namespace costs its first client: the first call (connect, handshake, the
    namespace created, the pool mapped) beside a ping on the open connection, and the first put
    of 8 x 1 MiB (pages never touched, the pool's first step maybe still being committed) beside
    the same put into blocks touched before (the keys removed, then put again)."""
    pool = PoolAllocator(16 * MiB, name="bench-first", pretouch=False)
    srcs = [pool.allocate((256, 1024), torch.float32, MemoryFormat.EC_TD) for _ in range(8)]
    items = [(_kb(900 + i), o) for i, o in enumerate(srcs) if o is not None]
    for _, o in items:
        o.tensor.normal_()
    fresh = ServerClient(sock, "bench-first", timeout_s=30.0)
    try:
        t0 = time.perf_counter()
        assert fresh.ping()
        t_map = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert fresh.ping()
        t_ping = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert fresh.put(items) == [True] * len(items)
        t_first = time.perf_counter() - t0
        warm = []
        for _ in range(max(opts.reps, 3)):
            assert fresh.remove([k for k, _ in items]) is not None
            t0 = time.perf_counter()
            assert fresh.put(items) == [True] * len(items)
            warm.append(time.perf_counter() - t0)
    finally:
        fresh.close()
        for _, o in items:
            o.ref_count_down()
    return [
        Result(
            SUITE, "first call of a fresh namespace (connect + map)", t_map * 1e3, "ms",
            "ping on the open connection", t_ping * 1e3, note="first-map cost, once per client and namespace",
        ),
        Result(
            SUITE, "first put 8 x 1 MiB (fresh pages)", t_first * 1e3, "ms",
            "the same put into touched blocks (median)", statistics.median(warm) * 1e3,
            note="first-touch cost: pages faulted in on first use (the pool grows lazily)",
        ),
    ]  # fmt: skip


def _local_rows(
    t_contains: float,
    t_echo: float,
    t_get: float,
    t_base: float,
    t_asked: float,
    t_base2: float,
    t_view: float,
    t_echo2: float,
) -> list[Result]:
    """The rows of :func:`_local_figures` from its timings (seconds per call, each beside its
    baseline): contains, get copied out (location known; asked), get_view."""
    return [
        Result(
            SUITE,
            "contains (1 key)",
            t_contains * 1e6,
            "us",
            "unix-socket echo round trip",
            t_echo * 1e6,
            target=1.5,
            note="blocking client; server " + _loop_kind(),
        ),
        Result(
            SUITE,
            "get 1 MiB, copied out (location known)",
            t_get * 1e6,
            "us",
            "echo round trip + the same 1 MiB copy",
            t_base * 1e6,
            target=1.5,
            note="the default client: no round trip for an entry it read before",
        ),
        Result(
            SUITE,
            "get 1 MiB, copied out (asked: one READ)",
            t_asked * 1e6,
            "us",
            "echo round trip + the same 1 MiB copy",
            t_base2 * 1e6,
            target=1.5,
            note="remember_locations=False",
        ),
        Result(
            SUITE,
            "get_view 1 MiB (zero copy, lease + release)",
            t_view * 1e6,
            "us",
            "unix-socket echo round trip",
            t_echo2 * 1e6,
            note="for reference: the server wakes twice (the lease, then its release)",
        ),
    ]


def _local_figures(opts: BenchOptions, client: ServerClient, asking: ServerClient, echo_path: str) -> list[Result]:
    """contains, 1 MiB get (the default client and the asking one), get_view and the EC
    comparison, each beside its same-run baseline (:func:`_local_rows`, :func:`_ec_figure`)."""
    reps = opts.reps
    inner = 50 if opts.quick else 400
    staging = PoolAllocator(64 * MiB, name="bench-staging")
    staging.wait_ready(30)
    src_pool = PoolAllocator(8 * MiB, name="bench-src", pretouch=False)
    src = src_pool.allocate((256, 1024), torch.float32, MemoryFormat.EC_TD)  # 1 MiB
    assert src is not None
    src.tensor.copy_(torch.randn(256, 1024))
    assert client.put([(_kb(0), src)]) == [True]
    key = [_kb(0)]
    contains_msg = 9 + 3 + len(key[0])
    echo_small = _Echo(echo_path, contains_msg)
    copy = _SameCopy(staging)

    def contains() -> None:
        client.contains(key)

    def get() -> None:
        got = client.get(key, staging.allocate)
        assert got is not None and got[0] is not None
        got[0].ref_count_down()

    def get_asked() -> None:
        got = asking.get(key, staging.allocate)
        assert got is not None and got[0] is not None
        got[0].ref_count_down()

    def echo_plus_copy() -> None:
        echo_small.round_trip()
        copy.step()

    def view_sum() -> None:  # a caller that reads the entry where it lies, keeps nothing
        with client.get_view(key[0]) as view:
            assert view is not None
            buf = view.buffer
            assert buf is not None and buf[0] >= 0 and buf[-1] >= 0

    t_contains, t_echo = alternate([_per_op(contains, inner), _per_op(echo_small.round_trip, inner)], reps=reps)
    t_get, t_base = alternate([_per_op(get, inner // 4), _per_op(echo_plus_copy, inner // 4)], reps=reps)
    t_asked, t_base2 = alternate([_per_op(get_asked, inner // 4), _per_op(echo_plus_copy, inner // 4)], reps=reps)
    t_view, t_echo2 = alternate([_per_op(view_sum, inner), _per_op(echo_small.round_trip, inner)], reps=reps)
    out = _local_rows(t_contains, t_echo, t_get, t_base, t_asked, t_base2, t_view, t_echo2)
    out.append(_ec_figure(opts, client, staging, src, inner // 4, "locations known", 0.7))
    out.append(_ec_figure(opts, asking, staging, src, inner // 4, "asked: one READ each", None))
    echo_small.sock.close()
    src.ref_count_down()
    return out


EC_ENTRIES = 64
"""Entries both sides of the EC figure read in turn (64 MiB, past the caches): a reader of a
cache gets entries stored earlier, not the one it has just read."""


def _ec_figure(
    opts: BenchOptions,
    client: ServerClient,
    staging: PoolAllocator,
    src: MemoryObj,
    inner: int,
    how: str,
    target: float | None,
) -> Result:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.engines.encoder_cache import ECCacheEngine
    from lmcache_async.metadata import LMCacheEngineMetadata

    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.25, staging_size=0)
    with ECCacheEngine(cfg, LMCacheEngineMetadata("bench/server"), torch.float32) as ec:
        keys = [_kb(1000 + i) for i in range(EC_ENTRIES)]
        hashes = [f"{i:016x}" for i in range(EC_ENTRIES)]
        for k, h in zip(keys, hashes, strict=True):
            assert client.put([(k, src)]) == [True]
            assert ec.put(h, src.tensor)
        srv_turn = itertools.cycle(keys)
        ec_turn = itertools.cycle(hashes)

        def server_get() -> None:
            got = client.get([next(srv_turn)], staging.allocate)
            assert got is not None and got[0] is not None
            got[0].ref_count_down()

        def ec_get() -> None:
            t = ec.get(next(ec_turn))
            assert t is not None

        t_srv, t_ec = alternate([_per_op(server_get, inner), _per_op(ec_get, inner)], reps=opts.reps)
    return Result(
        SUITE,
        f"get 1 MiB (server, copy; {how}) vs in-process EC get",
        MiB / t_srv / 1e9,
        "GB/s",
        "in-process EC get",
        MiB / t_ec / 1e9,
        higher_is_better=True,
        note=f"both read {EC_ENTRIES} distinct 1 MiB entries in turn",
        target=target,
        target_kind="min",
    )


def _loop_kind() -> str:
    """The event loop both servers run (see :func:`~lmcache_async.server.server.event_loop_factory`)."""
    from lmcache_async.server.server import LOOP_ENV, event_loop_factory

    return "asyncio" if event_loop_factory(os.environ.get(LOOP_ENV, "auto")) is None else "uvloop"


def run(opts: BenchOptions) -> list[Result]:
    """Every server figure (see the module docstring), with this process and the servers it
    starts on one CPU (:func:`_one_cpu`)."""
    with _one_cpu():
        return _run(opts)


@contextlib.contextmanager
def _one_cpu() -> Iterator[None]:
    """Run this process, and the children it starts meanwhile, on one CPU (the last it may use).

    A round trip between processes on two otherwise idle vCPUs of this VM waits for the other
    vCPU to wake: 10 µs one run, 70 µs the next, whichever of the echo and the cache server got
    the far CPU. On one CPU both pay the same context switch, so the ratio measures the
    protocol. torch runs one intra-op thread meanwhile (a second one on the same CPU would only
    wait for a time slice: a 1 MiB ``clone`` then takes milliseconds), so the in-process EC
    ``get`` copies on one thread, as the client does. ``LMCACHE_ASYNC_BENCH_PIN=0`` leaves the
    placement and torch's threads as they are."""
    before = os.sched_getaffinity(0)
    if os.environ.get("LMCACHE_ASYNC_BENCH_PIN", "1") == "0" or len(before) < 2:
        yield
        return
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {max(before)})
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, before)


def _run(opts: BenchOptions) -> list[Result]:
    # A Unix socket path is limited to 107 bytes: the sockets live in a short directory under
    # the system temp dir, whatever the work dir is.
    with tempfile.TemporaryDirectory(prefix="lmc-bench-srv-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)
        sock = str(work / "s" / "cache.sock")
        echo_path = str(work / "echo.sock")
        cfg = work / "server.yaml"
        pool_gib = 0.125 if opts.quick else 0.5
        cfg.write_text(f"max_local_cpu_size: {pool_gib}\n")
        server = subprocess.Popen(
            [sys.executable, "-m", "lmcache_async.cli", "serve", "--socket", sock, "--config", str(cfg)],
            stderr=subprocess.DEVNULL,
        )
        echo = subprocess.Popen([sys.executable, "-c", _ECHO, echo_path], stderr=subprocess.DEVNULL)
        client: ServerClient | None = None
        try:
            _wait_socket(echo_path, echo)
            deadline = time.monotonic() + 120
            while True:
                try:
                    query_status(sock, timeout_s=2.0)
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise RuntimeError("the cache server did not start") from None
                    time.sleep(0.1)
            opts.say("server: the first call and put of a fresh namespace")
            first = _first_touch(opts, sock)
            opts.say("server: measuring contains and 1 MiB get")
            client = ServerClient(sock, "bench", timeout_s=30.0)
            _warm_up(client, pool_gib)
            asking = ServerClient(sock, "bench", timeout_s=30.0, remember_locations=False)
            try:
                results = _local_figures(opts, client, asking, echo_path)
            finally:
                asking.close()
            opts.say("server: put/get vs the Redis tier")
            from .server_redis import redis_figures  # it imports this module

            results += with_redis(opts, "server vs redis", lambda url: redis_figures(opts, client, url))
            return first + results
        finally:
            if client is not None:
                client.close()
            for p in (server, echo):
                p.terminate()
            for p in (server, echo):
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    from .common import format_table

    quick = "--quick" in sys.argv
    print(format_table(run(BenchOptions(progress=print, quick=quick))))
