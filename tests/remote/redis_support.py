"""Helpers of the Redis/Valkey/Cluster tests (test_remote_redis*.py): byte comparison of entries
and the keys a server holds under a prefix."""

from __future__ import annotations

from lmcache_async.memory import MemoryObj
from lmcache_async.testing.servers import RedisServer


def same(a: MemoryObj, b: MemoryObj) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.byte_view()) == bytes(b.byte_view())


def keys_under(srv: RedisServer, prefix: str) -> list[bytes]:
    return sorted(srv.command("KEYS", f"{prefix}:*"))
