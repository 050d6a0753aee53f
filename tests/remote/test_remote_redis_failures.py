"""Redis/Valkey/Cluster failures through the manager and the backend: a killed or hung server
gives misses within twice the timeout then recovers, reconnection after a restart, sharing between
two managers, 64 MiB entries through the manager and a cluster node restart. Real servers only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from redis.exceptions import RedisError

from lmcache_async import StorageManager
from lmcache_async.memory import PoolAllocator
from lmcache_async.testing import make_key, make_obj
from lmcache_async.testing.servers import RedisClusterServers, RedisServer

from .manager_support import remote_hits as _remote_hits
from .manager_support import tensor as _tensor
from .manager_support import wait_recovered
from .redis_support import same


# ---- failures of the server, through the manager ---------------------------------------------------
@pytest.mark.chaos
def test_killed_server_gives_misses_within_twice_the_timeout_then_recovers(
    own_server: RedisServer, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    timeout = 1.0
    sm = make_manager(remote_url=own_server.url, remote_timeout_s=timeout, remote_key_prefix=prefix, local_cpu=False)
    k = make_key(1)
    assert sm.put_sync(k, _tensor(1))
    sm.flush_sync(30)
    got = sm.get_sync(k)
    assert got is not None
    got.ref_count_down()
    own_server.kill()
    for i in range(5):
        t0 = time.monotonic()
        assert sm.get_sync(make_key(100 + i)) is None
        assert sm.contains_sync(make_key(100 + i)) is False
        assert sm.prefix_len_sync([k, make_key(100 + i)]) == 0
        assert time.monotonic() - t0 < 2 * timeout * 3  # three calls, each bounded by 2x the timeout
    assert sm.put_sync(make_key(200), _tensor(200))  # accepted; its write-through fails quietly
    sm.flush_sync(30)
    remote = sm.stats()["tiers"]["remote"]
    assert remote["errors"] + remote["skipped"] > 0
    own_server.restart()
    wait_recovered(sm, 300, deadline_s=40.0)
    assert sm.stats()["tiers"]["remote"]["circuit"] == "closed"


@pytest.mark.chaos
def test_hung_server_calls_return_within_twice_the_timeout_then_recover(
    own_server: RedisServer, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    timeout = 0.5
    sm = make_manager(remote_url=own_server.url, remote_timeout_s=timeout, remote_key_prefix=prefix, local_cpu=False)
    k = make_key(1)
    assert sm.put_sync(k, _tensor(1))
    sm.flush_sync(30)
    own_server.pause()
    try:
        for i in range(4):
            t0 = time.monotonic()
            assert sm.get_sync(make_key(10 + i)) is None
            assert time.monotonic() - t0 < 2 * timeout
            t0 = time.monotonic()
            assert sm.contains_sync(make_key(10 + i)) is False
            assert time.monotonic() - t0 < 2 * timeout
        assert sm.stats()["tiers"]["remote"]["timeouts"] + sm.stats()["tiers"]["remote"]["skipped"] >= 4
    finally:
        own_server.resume()
    wait_recovered(sm, 50, deadline_s=40.0)
    got = sm.get_sync(k)  # written before the pause, still there
    assert got is not None
    with got:
        assert torch.equal(got.tensor, _tensor(1))


async def test_backend_reconnects_after_a_server_restart(
    own_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(own_server.url)
    src = make_obj(src_pool, seed=12)
    assert await be.put(make_key(12), src)
    own_server.restart()  # the data is gone; pooled connections are dead
    assert await be.put(make_key(13), src)
    got = await be.get(make_key(13))
    assert got is not None and same(got, src)
    got.ref_count_down()
    assert await be.get(make_key(12)) is None
    src.ref_count_down()


def test_two_managers_share_entries_through_one_server(
    redis_server: RedisServer, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    a = make_manager(remote_url=redis_server.url, remote_key_prefix=prefix, remote_timeout_s=30.0)
    b = make_manager(remote_url=redis_server.url, remote_key_prefix=prefix, remote_timeout_s=30.0)
    keys = [make_key(i) for i in range(6)]
    for i, k in enumerate(keys):
        assert a.put_sync(k, _tensor(i))
    a.flush_sync(30)
    assert b.prefix_len_sync(keys) == 6
    for i, k in enumerate(keys):
        got = b.get_sync(k)
        assert got is not None
        with got:
            assert torch.equal(got.tensor, _tensor(i))
    assert _remote_hits(b) == 6
    assert b.contains_sync(keys[0])  # promoted into b's CPU tier


def test_64mib_entry_round_trips_through_the_manager(
    redis_server: RedisServer, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    sm = make_manager(
        remote_url=redis_server.url,
        remote_key_prefix=prefix,
        local_cpu=False,
        remote_timeout_s=30.0,
        blocking_timeout_secs=60,
    )
    t = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    key = make_key(5)
    assert sm.put_sync(key, t)
    sm.flush_sync(60)
    got = sm.get_sync(key)
    assert got is not None
    with got:
        assert torch.equal(got.tensor, t)
    assert _remote_hits(sm) == 1


@pytest.mark.chaos
async def test_cluster_tier_recovers_after_a_node_restart(
    server_binary: str, open_backend: Any, src_pool: PoolAllocator
) -> None:
    with RedisClusterServers(3, server_binary) as cluster:
        be = await open_backend(cluster.url, timeout_s=2.0)
        keys = [make_key(3000 + i) for i in range(24)]
        src = make_obj(src_pool, (16, 16), seed=1)
        try:
            for k in keys:
                assert await be.put(k, src)
            cluster.nodes[0].kill()
            with pytest.raises((RedisError, OSError)):
                await be.batched_contains(keys)  # a third of the slots is unreachable: raised, not guessed
            cluster.nodes[0].restart()
            cluster.wait_ok()
            flags = await be.batched_contains(keys)  # the connector refreshed its slot map by itself
            assert 0 < sum(flags) < len(keys)  # the restarted node lost its share (no persistence)
            for k in keys:
                assert await be.put(k, src)
            for k in keys:
                got = await be.get(k)
                assert got is not None and same(got, src)
                got.ref_count_down()
            assert be.stats()["slot_refreshes"] >= 2
        finally:
            src.ref_count_down()
            await be.close()
