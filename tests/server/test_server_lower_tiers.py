"""The server's own lower tiers: write-through on commit, flush on SIGTERM, reads after eviction."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.testing.conformance import make_key, make_obj


def _kb(i: int) -> bytes:
    return make_key(i).to_string().encode()


def test_entries_survive_a_server_restart_through_its_disk_tier(make_server, tmp_path) -> None:
    disk = tmp_path / "disk"
    srv = make_server(local_disk=str(disk), max_local_disk_size=0.25).start()
    pool = PoolAllocator(16 << 20, name="t", pretouch=False)
    objs = [make_obj(pool, (64, 64), torch.float32, MemoryFormat.KV_2LTD, seed=i) for i in range(6)]
    client = ServerClient(srv.socket, "disk-ns", timeout_s=10.0, max_backoff_s=0.5)
    try:
        assert client.put([(_kb(i), o) for i, o in enumerate(objs)]) == [True] * 6
        assert srv.stop() == 0  # SIGTERM flushes the write-through, exits 0 ...
        assert not Path(srv.socket).exists()  # ... and removes the socket
        srv.start()
        assert srv.status()["tiers"][:2] == ["shm", "disk"]
        got = None
        deadline = time.monotonic() + 30
        while got is None and time.monotonic() < deadline:  # the breaker lets a call through after its back-off
            got = client.get([_kb(i) for i in range(6)], pool.allocate)
            time.sleep(0.05)
        assert got is not None
        for g, o in zip(got, objs, strict=True):
            assert g is not None and torch.equal(g.tensor, o.tensor)
            g.ref_count_down()
        ns = srv.status()["namespaces"]["disk-ns"]
        assert ns["loaded_from_lower_tiers"] == 6
        # Another namespace never sees them, even though they are on the same disk tier.
        other = ServerClient(srv.socket, "other-ns", timeout_s=10.0)
        assert other.contains([_kb(0)]) == [False]
        other.close()
    finally:
        for o in objs:
            o.ref_count_down()
        client.close()


def test_an_entry_evicted_from_the_pool_is_read_back_from_disk(make_server, tmp_path) -> None:
    srv = make_server(max_local_cpu_size=1 / 256, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.25).start()
    pool = PoolAllocator(32 << 20, name="t", pretouch=False)
    client = ServerClient(srv.socket, "evict-disk", timeout_s=10.0)
    try:
        objs = [
            make_obj(pool, (256, 256), torch.float32, MemoryFormat.KV_2LTD, seed=i) for i in range(24)
        ]  # 256 KiB each, 6 MiB in all
        for i, o in enumerate(objs):
            assert client.put([(_kb(i), o)]) == [True]
        assert srv.status()["namespaces"]["evict-disk"]["evictions"] > 0
        assert client.contains([_kb(i) for i in range(24)]) == [True] * 24
        got = client.get([_kb(0)], pool.allocate)
        assert got is not None and got[0] is not None and torch.equal(got[0].tensor, objs[0].tensor)
        got[0].ref_count_down()
        for o in objs:
            o.ref_count_down()
    finally:
        client.close()


def test_a_hold_on_an_entry_only_the_disk_tier_has_brings_it_back_and_pins_it(make_server, tmp_path) -> None:
    srv = make_server(max_local_cpu_size=1 / 256, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.25).start()
    pool = PoolAllocator(32 << 20, name="t", pretouch=False)
    client = ServerClient(srv.socket, "hold-disk", timeout_s=10.0)
    objs = [make_obj(pool, (256, 256), torch.float32, MemoryFormat.KV_2LTD, seed=i) for i in range(24)]
    try:
        for i, o in enumerate(objs):
            assert client.put([(_kb(i), o)]) == [True]
        assert srv.status()["namespaces"]["hold-disk"]["evictions"] > 0  # entry 0 left the pool
        tokens = client.hold([_kb(0)], ttl_s=30.0)
        assert tokens is not None and tokens[0] != 0
        assert srv.status()["namespaces"]["hold-disk"]["loaded_from_lower_tiers"] >= 1
        assert client.remove([_kb(0)]) == [True]  # gone from every tier: the hold still reads it
        got = client.get_held(tokens, pool.allocate)
        assert got is not None and got[0] is not None and torch.equal(got[0].tensor, objs[0].tensor)
        got[0].ref_count_down()
        assert client.unhold(tokens)
    finally:
        for o in objs:
            o.ref_count_down()
        client.close()
