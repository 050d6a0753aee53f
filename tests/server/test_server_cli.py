"""``lmcache-async status`` and the client tier as a StorageManager tier."""

from __future__ import annotations

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, StorageManager
from lmcache_async.backend import LocalTier
from lmcache_async.cli import main
from lmcache_async.testing.conformance import make_key


def _config(socket: str, namespace: str) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        local_cpu=False,
        tier_order=["server"],
        cache_server_socket=socket,
        cache_server_namespace=namespace,
        staging_size=1 / 64,
        remote_timeout_s=10.0,
    )


def test_status_prints_tiers_clients_and_namespaces(shared_server, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    sm = StorageManager(_config(shared_server.socket, "cli-status"), name="cli")
    try:
        assert sm.put_sync(make_key(1), torch.ones(8, 8))
        sm.flush_sync()
        assert main(["status", "--socket", shared_server.socket]) == 0
    finally:
        sm.close_sync()
    out = capsys.readouterr().out
    assert "tiers    shm" in out
    assert "namespace 'cli-status': 1 entries" in out


def test_status_without_a_server_fails_with_status_1(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["status", "--socket", str(tmp_path / "none.sock"), "--timeout", "1"]) == 1
    assert "no cache server answers" in capsys.readouterr().err


def test_server_tier_is_a_local_tier(shared_server) -> None:  # type: ignore[no-untyped-def]
    sm = StorageManager(_config(shared_server.socket, "cli-local"), name="local")
    try:
        tier = sm.backend("server")
        assert tier is not None and isinstance(tier, LocalTier)
    finally:
        sm.close_sync()


def test_two_managers_on_the_server_tier_alone_share_entries(shared_server) -> None:  # type: ignore[no-untyped-def]
    writer = StorageManager(_config(shared_server.socket, "cli-share"), name="writer")
    reader = StorageManager(_config(shared_server.socket, "cli-share"), name="reader")
    try:
        keys = [make_key(i) for i in range(4)]
        values = [torch.randn(16, 32) for _ in keys]
        assert all(writer.batched_put_sync(keys, values))
        writer.flush_sync()
        assert reader.batched_contains_sync(keys) == 4
        for k, v in zip(keys, values, strict=True):
            got = reader.get_sync(k)
            assert got is not None and torch.equal(got.tensor, v)
            got.ref_count_down()
    finally:
        writer.close_sync()
        reader.close_sync()
