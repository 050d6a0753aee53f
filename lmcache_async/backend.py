"""Deprecated: the tier contract and registry moved to :mod:`lmcache_async.tiers`.

``lmcache_async.backend`` keeps its old names for one release; importing any of them warns
(``DeprecationWarning``). Import from :mod:`lmcache_async.tiers` instead.
"""

from __future__ import annotations

import warnings
from typing import Any

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


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module 'lmcache_async.backend' has no attribute {name!r}")
    warnings.warn(
        f"lmcache_async.backend.{name} moved to lmcache_async.tiers; the old path goes away in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    import importlib

    return getattr(importlib.import_module(f"lmcache_async.tiers.{where}"), name)
