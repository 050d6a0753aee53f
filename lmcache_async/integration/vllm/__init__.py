"""vLLM integration: the encoder-cache connector and the KV connector.

* :class:`LMCacheECConnectorImpl` — framework-free connector logic (no vLLM import);
* ``LMCacheECConnector`` — the ``ECConnectorBase`` subclass vLLM loads with
  ``ec_connector_module_path="lmcache_async.integration.vllm"``; it (and
  ``LMCacheECConnectorMetadata``) is imported lazily, so importing this package does not
  import vLLM. See ``docs/vllm.md``.
* ``LMCacheKVConnector`` — the ``KVConnectorBase_V1`` subclass vLLM loads with
  ``kv_connector_module_path="lmcache_async.integration.vllm"`` (and
  ``LMCacheKVConnectorMetadata``); also imported lazily.
* ``LMCacheKVHiddenStatesConnector`` — the KV connector for engines run with vLLM's
  ``extract_hidden_states`` speculative method: it also stores and restores their hidden-state
  KV-cache group (``SupportsHMA``); loaded the same way, imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache_async.integration.vllm.ec.impl import (
    ECLoadMetadata,
    LMCacheECConnectorImpl,
    load_connector_config,
)
from lmcache_async.lazy_registry import LazyRegistry

if TYPE_CHECKING:
    from lmcache_async.integration.vllm.ec.connector import (
        LMCacheECConnector,
        LMCacheECConnectorMetadata,
    )
    from lmcache_async.integration.vllm.kv.connector import (
        LMCacheKVConnector,
        LMCacheKVConnectorMetadata,
    )
    from lmcache_async.integration.vllm.kv.hs_connector import LMCacheKVHiddenStatesConnector

_LAZY: LazyRegistry[Any] = LazyRegistry(
    "attribute",
    {
        "LMCacheECConnector": "lmcache_async.integration.vllm.ec.connector:LMCacheECConnector",
        "LMCacheECConnectorMetadata": "lmcache_async.integration.vllm.ec.connector:LMCacheECConnectorMetadata",
        "LMCacheKVConnector": "lmcache_async.integration.vllm.kv.connector:LMCacheKVConnector",
        "LMCacheKVConnectorMetadata": "lmcache_async.integration.vllm.kv.connector:LMCacheKVConnectorMetadata",
        "LMCacheKVHiddenStatesConnector": (
            "lmcache_async.integration.vllm.kv.hs_connector:LMCacheKVHiddenStatesConnector"
        ),
    },
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _LAZY.get(name)
    globals()[name] = value
    return value


__all__ = [
    "ECLoadMetadata",
    "LMCacheECConnector",
    "LMCacheECConnectorImpl",
    "LMCacheECConnectorMetadata",
    "LMCacheKVConnector",
    "LMCacheKVConnectorMetadata",
    "LMCacheKVHiddenStatesConnector",
    "load_connector_config",
]
