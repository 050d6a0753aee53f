"""Several client processes on one cache server: sharing, mixed load, clean stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lmcache_async.server.shm import OPTIMISTIC_READS

WORKER = str(Path(__file__).resolve().parent / "client_worker.py")


def _worker(srv, ns: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, WORKER, srv.socket, ns, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_entries_put_by_one_process_are_read_bit_exact_by_another_started_earlier(shared_server) -> None:
    srv = shared_server
    reader = _worker(srv, "shared", "wait-get", "40")
    assert reader.stdout is not None and reader.stdin is not None
    assert reader.stdout.readline().strip() == "ready"
    writer = _worker(srv, "shared", "put", "40")
    out, err = writer.communicate(timeout=120)
    assert out.strip() == "stored 40", err
    reader.stdin.write("go\n")
    reader.stdin.flush()
    out, err = reader.communicate(timeout=120)
    assert out.strip() == "got 40 wrong 0", err


def test_a_namespace_does_not_see_another_namespaces_entries(shared_server) -> None:
    srv = shared_server
    out, err = _worker(srv, "ns-a", "put", "5").communicate(timeout=120)
    assert out.strip() == "stored 5", err
    reader = _worker(srv, "ns-b", "wait-get", "5")
    out, err = reader.communicate("go\n", timeout=120)
    assert out.strip().endswith("got 0 wrong 0"), err


def test_eight_clients_of_mixed_load_see_no_errors_no_wrong_bytes_and_flat_server_rss(make_server) -> None:
    seconds = 60.0 if os.environ.get("LMCACHE_ASYNC_SOAK") == "1" else 15.0
    srv = make_server(cache_server_pretouch=True).start()
    procs = [_worker(srv, "load", "load", str(seconds), str(seed)) for seed in range(8)]
    # RSS once every client is connected and the load runs (start-up imports take a while here).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and srv.status()["clients"] < 8:
        time.sleep(0.2)
    time.sleep(min(3.0, seconds / 5))
    rss_start = srv.rss_bytes()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    rss_end = srv.rss_bytes()
    assert all(r["ops"] > 0 for r in results)
    assert sum(r["errors"] for r in results) == 0, results
    assert sum(r["wrong"] for r in results) == 0, results
    if OPTIMISTIC_READS:
        assert sum(r["client"]["known_reads"] for r in results) > 0  # reads from remembered locations ran
    assert rss_end - rss_start < 16 << 20, (rss_start, rss_end)
    ns = srv.status()["namespaces"]["load"]
    assert ns["leases"] == 0 and ns["grants"] == 0 and ns["clients"] == 0
    assert ns["pool_used_bytes"] == ns["committed_block_bytes"]
