"""What the stalled-reader check costs beside a 1 MiB get (run as a script, prints one line).

``python tests/server/lease_check_cost.py``: starts a test server, stores one 1 MiB entry and
times, alternating in rounds (median of rounds, each the median of its calls): a 1 MiB get asked
with one READ, a 1 MiB get under a lease (``get_held``: GET, copy, the check, RELEASE) and the
check a leased copy runs after copying (:func:`lmcache_async.server.client._leases_held`: a clock
read and one non-blocking peek), all on the same connection. Lease-free reads run no new check:
they rely on the version table as before.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.server.client_wire import leases_held as _leases_held
from lmcache_async.testing.cache_server import CacheServerProcess
from lmcache_async.testing.conformance import make_key, make_obj


def _per_call(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    srv = CacheServerProcess(Path(tempfile.mkdtemp()) / "srv").start()
    try:
        pool = PoolAllocator(64 << 20, name="cost", pretouch=True)
        pool.wait_ready(30)
        client = ServerClient(srv.socket, "cost", timeout_s=10.0, remember_locations=False)
        key = make_key(1).to_string().encode()
        obj = make_obj(pool, (512, 512), torch.float32, MemoryFormat.KV_2LTD, seed=1)  # 1 MiB
        assert client.put([(key, obj)]) == [True]
        tokens = client.hold([key], ttl_s=600)
        assert tokens and tokens[0]

        def get_asked() -> None:
            got = client.get([key], pool.allocate)
            assert got is not None and got[0] is not None
            got[0].ref_count_down()

        def get_leased() -> None:
            got = client.get_held(tokens, pool.allocate)
            assert got is not None and got[0] is not None
            got[0].ref_count_down()

        conn = client._conn
        assert conn is not None
        until = time.monotonic() + 600

        def check() -> None:
            assert _leases_held(conn, until)

        rounds: dict[str, list[float]] = {"asked": [], "leased": [], "check": []}
        for _ in range(7):
            rounds["asked"].append(_per_call(get_asked, 200))
            rounds["leased"].append(_per_call(get_leased, 200))
            rounds["check"].append(_per_call(check, 2000))
        med = {k: statistics.median(v) * 1e6 for k, v in rounds.items()}
        print(
            f"1 MiB get asked (READ): {med['asked']:.1f} us; 1 MiB get under a lease (get_held): "
            f"{med['leased']:.1f} us; the stalled-reader check: {med['check']:.2f} us = "
            f"{100 * med['check'] / med['leased']:.1f} % of the leased get, "
            f"{100 * med['check'] / med['asked']:.1f} % of the asked get"
        )
        obj.ref_count_down()
        client.close()
    finally:
        srv.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
