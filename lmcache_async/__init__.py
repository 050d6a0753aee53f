"""lmcache_async: an asyncio-native tiered storage framework for LLM-inference caches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache_async import _moved
from lmcache_async.config import LMCacheEngineConfig, load_ec_engine_config, load_engine_config
from lmcache_async.errors import (
    ConfigError,
    DoubleReleaseError,
    ForkedProcessError,
    LoopThreadCallError,
    ManagerClosedError,
    MisuseError,
    PoolSizeError,
)
from lmcache_async.key_extras import KeyExtras, MMItem
from lmcache_async.keys import CacheEngineKey, stable_u64_from_str
from lmcache_async.lazy_registry import LazyRegistry
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.metrics import serve_metrics
from lmcache_async.storage_manager import StorageManager
from lmcache_async.tiers import LocalTier, PoolTier, Presence, StorageBackend, register_backend
from lmcache_async.token_database import ChunkedTokenDatabase

_moved.install()  # the module paths that moved in 0.2.0 keep importing, with a warning

if TYPE_CHECKING:
    from lmcache_async.engines.encoder_cache import ECCacheEngine
    from lmcache_async.engines.hidden_states import HiddenStateStore
    from lmcache_async.engines.kv import LMCacheEngine

__version__ = "0.2.0"

_LAZY: LazyRegistry[Any] = LazyRegistry(
    "attribute",
    {
        "LMCacheEngine": "lmcache_async.engines.kv:LMCacheEngine",
        "HiddenStateStore": "lmcache_async.engines.hidden_states:HiddenStateStore",
        "ECCacheEngine": "lmcache_async.engines.encoder_cache:ECCacheEngine",
    },
)
"""The engines, imported on first access (importing the package does not import them)."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lmcache_async' has no attribute {name!r}")
    value = _LAZY.get(name)
    globals()[name] = value
    return value


__all__ = [
    "CacheEngineKey",
    "ChunkedTokenDatabase",
    "ConfigError",
    "DoubleReleaseError",
    "ECCacheEngine",
    "ForkedProcessError",
    "HiddenStateStore",
    "KeyExtras",
    "LMCacheEngine",
    "LMCacheEngineConfig",
    "LMCacheEngineMetadata",
    "LocalTier",
    "LoopThreadCallError",
    "MMItem",
    "ManagerClosedError",
    "MemoryFormat",
    "MemoryObj",
    "MisuseError",
    "PoolSizeError",
    "PoolTier",
    "Presence",
    "StorageBackend",
    "StorageManager",
    "__version__",
    "load_ec_engine_config",
    "load_engine_config",
    "register_backend",
    "serve_metrics",
    "stable_u64_from_str",
]
