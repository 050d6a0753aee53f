"""SGLang HiCache storage backend on lmcache_async (see ``docs/sglang.md``).

``LMCacheHiCacheStorage`` is loaded by SGLang's storage factory with
``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "lmcache_async", "module_path": "lmcache_async.integration.sglang",
"class_name": "LMCacheHiCacheStorage", "interface_v1": 1, ...}``. The class is imported on
first use, and needs SGLang then (``scripts/sglang_env.sh`` builds an environment with it); the
layout adapter (:mod:`.pool_layout`) and the key namespace (:mod:`.settings`) import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_async.integration.sglang.backend import COUNTER_NAMES, LMCacheHiCacheStorage

__all__ = ["COUNTER_NAMES", "LMCacheHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lmcache_async.integration.sglang import backend

    value = getattr(backend, name)
    globals()[name] = value
    return value
