"""Namespace pools grow lazily: a sparse memfd of the full size, committed in steps as it fills."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.memory import MemoryFormat, MiB
from lmcache_async.server.client import ServerClient
from lmcache_async.server.growth import PoolGrowth, memory_total_bytes
from lmcache_async.server.namespace import Namespace
from lmcache_async.server.protocol import EntryMeta
from lmcache_async.server.shm import GROW_STEP_MIN, SEALS
from lmcache_async.testing.cache_server import private_dir

WORKER = str(Path(__file__).resolve().parent / "client_worker.py")
DEFAULT_POOL_GIB = LMCacheEngineConfig.model_fields["max_local_cpu_size"].default


def _run(srv, ns: str, *args: str) -> str:
    # The client's default call timeout (2 s), as a user's first client has it.
    env = dict(os.environ, OMP_NUM_THREADS="1", LMCACHE_TEST_WORKER_TIMEOUT_S="2.0")
    out = subprocess.run(
        [sys.executable, WORKER, srv.socket, ns, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_fresh_server_of_the_default_pool_size_stores_the_first_put_for_another_process(make_server) -> None:
    srv = make_server(max_local_cpu_size=DEFAULT_POOL_GIB, cache_server_pretouch=True).start()
    stored = _run(srv, "first", "first-put", "8")
    assert stored.startswith("stored 8 "), stored
    assert _run(srv, "first", "get-big", "8") == "got 8 wrong 0"
    ns = srv.status()["namespaces"]["first"]
    assert ns["pool_capacity_bytes"] == int(DEFAULT_POOL_GIB * (1 << 30))
    assert 8 * MiB <= ns["pool_committed_bytes"] < ns["pool_capacity_bytes"]  # only what it holds is committed


def test_a_pool_file_is_sparse_and_sealed_until_it_is_committed() -> None:
    ns = Namespace("t", 512 * MiB, lease_ttl_s=60.0, max_leases=8, max_grants=8, pretouch=False, committed_bytes=0)
    try:
        pool = ns.pool
        assert pool.committed == 0 and pool.can_grow
        assert fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        assert os.fstat(pool.fd).st_blocks * 512 < MiB  # the full size, no memory behind it
        assert ns.grant(ns.add_client(1), MiB) is None  # nothing committed: no block yet
    finally:
        ns.close()


def _meta(n: int) -> EntryMeta:
    return EntryMeta.of((n,), torch.uint8, MemoryFormat.KV_2LTD)


async def test_a_pool_commits_steps_in_the_background_as_it_fills_and_evicts_nothing_meanwhile() -> None:
    growth = PoolGrowth(reserve_bytes=0)
    ns = Namespace("t", 512 * MiB, lease_ttl_s=60.0, max_leases=8, max_grants=1024, pretouch=False, committed_bytes=0)
    try:
        pool = ns.pool
        first = growth.maybe_grow(pool)
        assert first is not None and await first is True
        assert pool.committed == GROW_STEP_MIN
        st = ns.add_client(1)
        loop = asyncio.get_running_loop()
        for i in range(96):  # 96 MiB: past the first step
            got = ns.grant(st, MiB, count_refusal=False)
            while got is None:
                assert await growth.wait_room(pool, loop.time() + 30.0)
                got = ns.grant(st, MiB, count_refusal=False)
            growth.maybe_grow(pool)
            gid = got[0]
            assert ns.commit(st, gid, f"k{i}".encode(), _meta(MiB)) == 1
        assert ns.evictions == 0 and len(ns) == 96
        assert GROW_STEP_MIN < pool.committed < pool.capacity
        assert os.fstat(pool.fd).st_blocks * 512 >= pool.committed
    finally:
        growth.close()
        ns.close()


async def test_a_step_that_does_not_fit_in_memory_is_refused_with_one_line_and_the_pool_evicts_within_what_it_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    growth = PoolGrowth(reserve_bytes=1 << 62)  # no step ever fits beside this reserve
    ns = Namespace(
        "t", 256 * MiB, lease_ttl_s=60.0, max_leases=8, max_grants=64, pretouch=False, committed_bytes=4 * MiB
    )
    try:
        pool = ns.pool
        with caplog.at_level(logging.WARNING, logger="lmcache_async.server.growth"):
            fut = growth.maybe_grow(pool)
            assert fut is not None and await fut is False
        lines = [r.getMessage() for r in caplog.records if "cannot grow" in r.getMessage()]
        assert len(lines) == 1 and "reserve" in lines[0], lines
        assert not pool.can_grow and pool.committed == 4 * MiB
        st = ns.add_client(1)
        for i in range(8):  # 8 MiB through a 4 MiB pool: the oldest entries make room
            got = ns.grant(st, MiB)
            assert got is not None
            assert ns.commit(st, got[0], f"k{i}".encode(), _meta(MiB)) == 1
        assert ns.evictions == 4 and growth.maybe_grow(pool) is None  # no retry before RETRY_S
    finally:
        growth.close()
        ns.close()


# ---- sizes ----------------------------------------------------------------------------------------
def test_a_pool_size_that_can_never_fit_is_refused_at_start_with_one_line(tmp_path: Path) -> None:
    total = memory_total_bytes()
    if total is None:
        pytest.skip("no /proc/meminfo")
    conf = tmp_path / "big.yaml"
    conf.write_text(f"max_local_cpu_size: {4 * total // (1 << 30) + 1}\n")
    sock = str(private_dir(tmp_path / "sock") / "c.sock")
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_async.cli", "serve", "--socket", sock, "--config", str(conf)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_local_cpu_size" in lines[0] and "can never fit" in lines[0], lines
    assert "Traceback" not in out.stderr


def test_a_client_refused_for_the_namespace_cap_is_told_so_not_full(
    make_server: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    srv = make_server(cache_server_max_namespaces=1).start()
    first = ServerClient(srv.socket, "one", timeout_s=5.0)
    second = ServerClient(srv.socket, "two", timeout_s=5.0)
    try:
        assert first.ping()
        with caplog.at_level(logging.WARNING, logger="lmcache_async.server.client"):
            assert not second.ping()
        text = " ".join(r.getMessage() for r in caplog.records)
        assert "TOO_MANY_NAMESPACES" in text and "cache_server_max_namespaces" in text, text
    finally:
        first.close()
        second.close()
