"""The Mooncake Store tier through the manager and its configuration: a killed or hung master
gives misses within twice the timeout then recovers, two managers share entries through one store,
and mooncake:// URLs and config keys (no store needed) build the Mooncake backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.testing import make_key
from lmcache_async.testing.servers import MooncakeServers

from .manager_support import remote_hits as _remote_hits
from .manager_support import tensor as _tensor
from .manager_support import wait_recovered

pytestmark = pytest.mark.mooncake


# ---- the store failing, through the manager ------------------------------------------------------------
@pytest.mark.chaos
def test_killed_master_gives_misses_within_twice_the_timeout_then_recovers(
    own_store: MooncakeServers, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    timeout = 1.0
    sm = make_manager(**own_store.config(remote_timeout_s=timeout, remote_key_prefix=prefix, local_cpu=False))
    k = make_key(1)
    assert sm.put_sync(k, _tensor(1))
    sm.flush_sync(30)
    got = sm.get_sync(k)
    assert got is not None
    with got:
        assert torch.equal(got.tensor, _tensor(1))
    own_store.kill_master()
    for i in range(5):
        t0 = time.monotonic()
        assert sm.get_sync(make_key(100 + i)) is None
        assert time.monotonic() - t0 < 2 * timeout
        t0 = time.monotonic()
        assert sm.contains_sync(make_key(100 + i)) is False
        assert sm.prefix_len_sync([k, make_key(100 + i)]) == 0
        assert time.monotonic() - t0 < 2 * 2 * timeout  # two calls, each within twice the timeout
    assert sm.put_sync(make_key(200), _tensor(200))  # accepted; its write-through fails quietly
    sm.flush_sync(30)
    remote = sm.stats()["tiers"]["remote"]
    assert remote["errors"] + remote["skipped"] > 0
    own_store.restart_master()
    wait_recovered(sm, 300)
    remote = sm.stats()["tiers"]["remote"]
    assert remote["circuit"] == "closed" and remote["corrupt"] == 0 and remote["setups"] >= 2


@pytest.mark.chaos
def test_hung_master_calls_return_within_twice_the_timeout_then_recover(
    own_store: MooncakeServers, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    timeout = 0.5
    sm = make_manager(**own_store.config(remote_timeout_s=timeout, remote_key_prefix=prefix, local_cpu=False))
    k = make_key(1)
    assert sm.put_sync(k, _tensor(1))
    sm.flush_sync(30)
    own_store.pause_master()
    try:
        for i in range(4):
            t0 = time.monotonic()
            assert sm.get_sync(make_key(10 + i)) is None
            assert time.monotonic() - t0 < 2 * timeout
            t0 = time.monotonic()
            assert sm.contains_sync(make_key(10 + i)) is False
            assert time.monotonic() - t0 < 2 * timeout
    finally:
        own_store.resume_master()
    wait_recovered(sm, 50)
    got = sm.get_sync(k)  # written before the pause, still there
    assert got is not None
    with got:
        assert torch.equal(got.tensor, _tensor(1))


def test_two_managers_share_entries_through_the_store(
    mooncake_store: MooncakeServers, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    a = make_manager(**mooncake_store.config(remote_key_prefix=prefix, remote_timeout_s=30.0))
    b = make_manager(**mooncake_store.config(remote_key_prefix=prefix, remote_timeout_s=30.0))
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


# ---- configuration (no store needed) -----------------------------------------------------------------
def test_mooncake_url_names_the_master_with_a_default_port() -> None:
    from lmcache_async.remote import parse_remote_url

    assert parse_remote_url("mooncake://10.0.0.5").hosts == (("10.0.0.5", 50051),)
    assert parse_remote_url("mooncake://10.0.0.5:6000").hosts == (("10.0.0.5", 6000),)
    assert parse_remote_url("mooncake://[::1]").hosts == (("::1", 50051),)
    for bad in ("mooncake://", "mooncake://a:1,b:2", "mooncake://h:1/db", "mooncake://h?x=1", "mooncake://u:p@h"):
        with pytest.raises(ValueError):
            parse_remote_url(bad)


async def test_remote_tier_of_a_mooncake_url_is_the_mooncake_backend(make_ctx: Any) -> None:
    from lmcache_async.remote import create
    from lmcache_async.remote.mooncake import MooncakeBackend

    ctx = make_ctx()
    ctx.config = LMCacheEngineConfig.from_defaults(remote_url="mooncake://127.0.0.1:1234", mooncake_replica_num=2)
    be = create(ctx)
    try:
        assert isinstance(be, MooncakeBackend) and be.is_remote and be.name == "remote"
        st = be.stats()
        assert st["scheme"] == "mooncake" and st["store_down"] and st["setups"] == 0  # nothing connected yet
    finally:
        assert be is not None
        await be.close()


def test_mooncake_settings_come_from_the_config_keys(make_ctx: Any) -> None:
    from lmcache_async.remote.mooncake import mooncake_settings

    ctx = make_ctx()
    ctx.config = LMCacheEngineConfig.from_defaults(remote_url="mooncake://m.example:7000")
    s = mooncake_settings(ctx, "mooncake://m.example:7000")
    assert s.master == "m.example:7000" and s.metadata_server == "http://m.example:8080/metadata"
    assert s.protocol == "tcp" and s.local_hostname == "127.0.0.1" and s.global_segment_size == 0
    ctx.config = LMCacheEngineConfig.from_defaults(mooncake_protocol="carrier-pigeon")
    with pytest.raises(ValueError, match="mooncake_protocol"):
        mooncake_settings(ctx, "mooncake://m.example:7000")
