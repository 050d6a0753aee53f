"""Configuration of a manager whose only tier is a node cache server (tests of the server tier)."""

from __future__ import annotations

from typing import Any

from lmcache_async import LMCacheEngineConfig


def server_tier_config(socket: str, namespace: str, **over: Any) -> LMCacheEngineConfig:
    """``tier_order: [server]`` on ``socket``/``namespace`` (no CPU tier, a small staging area,
    a generous timeout for a loaded test machine), with ``over`` applied on top."""
    base: dict[str, Any] = {
        "local_cpu": False,
        "tier_order": ["server"],
        "cache_server_socket": socket,
        "cache_server_namespace": namespace,
        "staging_size": 1 / 64,
        "remote_timeout_s": 10.0,
    }
    base.update(over)
    return LMCacheEngineConfig.from_defaults(**base)
