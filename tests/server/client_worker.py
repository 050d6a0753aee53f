"""A cache-server client process for the multi-process tests (run as a script).

Modes (argv: socket namespace mode ...):

* ``put N`` — store entries 0..N-1 and print ``stored <count>``.
* ``wait-get N`` — print ``ready``, wait for a line on stdin, then get entries 0..N-1 and print
  ``got <hits> wrong <wrong>``.
* ``first-put N`` — one put of the 1 MiB entries BIG..BIG+N-1; print ``stored <count> ms <latency>``.
* ``get-big N`` — one get of the 1 MiB entries BIG..BIG+N-1; print ``got <hits> wrong <wrong>``.
* ``load SECONDS SEED`` — mixed put/get/remove/contains over a shared key space for SECONDS;
  print one JSON line with ``ops``, ``errors``, ``wrong`` and the client's stats.
* ``stall-put I [partial]`` — put entry ``I``, stopping itself (``SIGSTOP``) right before the copy
  into the granted block (``partial``: after sending the server half a frame); print
  ``stored <count>`` once continued and done.
* ``stall-loop FIRST COUNT`` — put entries FIRST..FIRST+COUNT-1, one at a time, each stopping
  itself (``SIGSTOP``) right before its copy into the granted block; print ``put <0|1>`` after
  each put and ``stored <count>`` at the end.

Entry ``i``'s payload is a pure function of ``i``, so any process can check any entry; entries
from :data:`BIG` on are 1 MiB.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.server import client_writes, connection
from lmcache_async.server.client import ServerClient
from lmcache_async.server.protocol import FRAME, Op

#: Entries from this index on are 1 MiB (a copy long enough for a stop to land in a put).
BIG = 100_000


def key_of(i: int) -> bytes:
    return CacheEngineKey("mp/model", 1, 0, i + 1, torch.bfloat16).to_string().encode()


def shape_of(i: int) -> tuple[int, int]:
    return (1024, 256) if i >= BIG else (16 + (i % 7) * 8, 64)


def fill(pool: PoolAllocator, i: int) -> MemoryObj:
    obj = pool.allocate(shape_of(i), torch.float32, MemoryFormat.KV_2LTD)
    assert obj is not None
    g = torch.Generator().manual_seed(1000 + i)
    obj.tensor.copy_(torch.randn(shape_of(i), generator=g))
    return obj


def expected(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(shape_of(i), generator=g)


def check(obj: MemoryObj, i: int) -> bool:
    return obj.shape == shape_of(i) and obj.dtype == torch.float32 and torch.equal(obj.tensor, expected(i))


def _put(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``put N``: store entries 0..N-1 and print ``stored <count>``."""
    n = int(argv[3])
    stored = 0
    for i in range(n):
        obj = fill(pool, i)
        res = client.put([(key_of(i), obj)])
        obj.ref_count_down()
        stored += bool(res and res[0])
    print(f"stored {stored}", flush=True)


def _wait_get(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``wait-get N``: print ``ready``, wait for a line on stdin, then get entries 0..N-1."""
    n = int(argv[3])
    print("ready", flush=True)
    sys.stdin.readline()
    hits = wrong = 0
    got = client.get([key_of(i) for i in range(n)], pool.allocate) or []
    for i, hit in enumerate(got):
        if hit is not None:
            hits += 1
            wrong += not check(hit, i)
            hit.ref_count_down()
    print(f"got {hits} wrong {wrong}", flush=True)


def _first_put(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``first-put N``: one put of the 1 MiB entries BIG..BIG+N-1, with its latency."""
    objs = [fill(pool, BIG + i) for i in range(int(argv[3]))]
    t0 = time.perf_counter()
    res = client.put([(key_of(BIG + i), o) for i, o in enumerate(objs)]) or []
    ms = (time.perf_counter() - t0) * 1e3
    for o in objs:
        o.ref_count_down()
    print(f"stored {sum(map(bool, res))} ms {ms:.1f}", flush=True)


def _get_big(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``get-big N``: one get of the 1 MiB entries BIG..BIG+N-1."""
    n = int(argv[3])
    got_big = client.get([key_of(BIG + i) for i in range(n)], pool.allocate) or []
    hits = sum(o is not None for o in got_big)
    wrong = sum(not check(o, BIG + i) for i, o in enumerate(got_big) if o is not None)
    for hit in got_big:
        if hit is not None:
            hit.ref_count_down()
    print(f"got {hits} wrong {wrong}", flush=True)


def _stall(client: ServerClient, pool: PoolAllocator, argv: list[str], count: int) -> None:
    """Put ``count`` entries from ``argv[3]`` on, each stopping itself before its copy."""
    first = int(argv[3])
    copy = connection.copy_bytes  # a put copies in client_writes, with connection's copy_bytes

    def stalled_copy(*args: object, **kw: object) -> None:
        if argv[4:] == ["partial"]:  # the server then closes the connection (frame timeout)
            conn = client._conn
            assert conn is not None
            conn.sock.send(FRAME.pack(64, int(Op.PING), 0) + b"half")
        os.kill(os.getpid(), signal.SIGSTOP)  # a writer stalled inside its put
        copy(*args, **kw)  # type: ignore[arg-type]

    mock.patch.object(client_writes, "copy_bytes", stalled_copy).start()  # the name client_writes calls
    stored = 0
    for i in range(first, first + count):
        obj = fill(pool, i)
        res = client.put([(key_of(i), obj)])
        obj.ref_count_down()
        stored += bool(res and res[0])
        print(f"put {int(bool(res and res[0]))}", flush=True)
    print(f"stored {stored}", flush=True)


def _stall_put(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``stall-put I [partial]``: put entry ``I``, stopping itself before the copy."""
    _stall(client, pool, argv, 1)


def _stall_loop(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``stall-loop FIRST COUNT``: put COUNT entries, each stopping itself before its copy."""
    _stall(client, pool, argv, int(argv[4]))


def _load(client: ServerClient, pool: PoolAllocator, argv: list[str]) -> None:
    """``load SECONDS SEED``: mixed put/get/remove/contains for SECONDS; print one JSON line."""
    seconds, seed = float(argv[3]), int(argv[4])
    rng = random.Random(seed)
    ops = errors = wrong = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        batch = [rng.randrange(400) for _ in range(rng.randint(1, 6))]
        op = rng.random()
        if op < 0.3:
            objs = [fill(pool, i) for i in batch]
            res = client.put([(key_of(i), o) for i, o in zip(batch, objs, strict=True)])
            for o in objs:
                o.ref_count_down()
            errors += res is None
        elif op < 0.75:
            fetched = client.get([key_of(i) for i in batch], pool.allocate)
            if fetched is None:
                errors += 1
            else:
                for i, hit in zip(batch, fetched, strict=True):
                    if hit is not None:
                        wrong += not check(hit, i)
                        hit.ref_count_down()
        elif op < 0.85:  # freed blocks are granted again, for other keys' bytes
            errors += client.remove([key_of(i) for i in batch]) is None
        else:
            errors += client.contains([key_of(i) for i in batch], touch=op > 0.92) is None
        ops += 1
    print(json.dumps({"ops": ops, "errors": errors, "wrong": wrong, "client": client.stats()}), flush=True)


#: The worker's modes (argv[2]): each runs with the client, its pool and the whole argv.
MODES: dict[str, Callable[[ServerClient, PoolAllocator, list[str]], None]] = {
    "put": _put,
    "wait-get": _wait_get,
    "first-put": _first_put,
    "get-big": _get_big,
    "stall-put": _stall_put,
    "stall-loop": _stall_loop,
    "load": _load,
}


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    sock, ns, mode = argv[0], argv[1], argv[2]
    client = ServerClient(sock, ns, timeout_s=float(os.environ.get("LMCACHE_TEST_WORKER_TIMEOUT_S", "5")))
    pool = PoolAllocator(64 << 20, name="worker", pretouch=False)
    run = MODES.get(mode)
    if run is not None:  # an unknown mode does nothing
        run(client, pool, argv)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
