"""Deprecated: the tier contract and registry moved to :mod:`lmcache_async.tiers`.

``lmcache_async.backend`` keeps its old names for one release; importing any of them warns
(``DeprecationWarning``). Import from :mod:`lmcache_async.tiers` instead.
"""

from __future__ import annotations

from lmcache_async.deprecation import moved_names

# Nothing is star-exported: every old name is reached through __getattr__ below, and warns.
__all__: list[str] = []

_MOVED = {
    "Allocate": "abc",
    "BackendContext": "abc",
    "DirectReader": "abc",
    "LocalTier": "abc",
    "PoolTier": "abc",
    "Presence": "abc",
    "StorageBackend": "abc",
    "BUILTIN_TIER_KEYS": "registry",
    "ENTRY_POINT_GROUP": "registry",
    "BackendFactory": "registry",
    "get_backend_factory": "registry",
    "is_configured": "registry",
    "known_backends": "registry",
    "register_backend": "registry",
    "tier_config_errors": "registry",
}


__getattr__ = moved_names(__name__, {name: f"lmcache_async.tiers.{where}" for name, where in _MOVED.items()})
