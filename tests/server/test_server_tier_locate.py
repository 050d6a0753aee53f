"""The node server's tier says per entry whether it sits in the server's shared pool or only in
the server's own lower tiers (what the load-or-recompute decision prices)."""

from __future__ import annotations

from pathlib import Path

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.storage_manager import StorageManager
from lmcache_async.testing import make_key
from lmcache_async.testing.cache_server import CacheServerProcess


def _client(server: CacheServerProcess) -> StorageManager:
    cfg = LMCacheEngineConfig.from_defaults(local_cpu=False, tier_order=["server"], cache_server_socket=server.socket)
    return StorageManager(cfg)


def test_an_entry_only_in_the_servers_lower_tier_is_located_but_not_in_memory(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    key, absent = make_key(1), make_key(2)
    server = CacheServerProcess(tmp_path / "a", local_disk=str(disk), max_local_disk_size=0.05).start()
    try:
        with _client(server) as sm:
            assert sm.put_sync(key, torch.arange(256.0))
            assert sm.locate_memory_sync([key, absent]) == [("server", True), None]
    finally:
        assert server.stop() == 0  # flushes its write-through to the disk tier
    # a fresh pool, the same disk
    server = CacheServerProcess(tmp_path / "b", local_disk=str(disk), max_local_disk_size=0.05).start()
    try:
        with _client(server) as sm:
            assert sm.locate_memory_sync([key, absent]) == [("server", False), None]
            assert sm.locate_sync([key]) == ["server"]
    finally:
        server.stop()
