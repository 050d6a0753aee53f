"""vLLM-Omni stage connector on lmcache_async's tiers.

Register once per process, before Omni builds its connectors::

    from lmcache_async.integration.omni import register
    register()   # OmniConnectorFactory now knows "LMCacheOmniConnector"

(also run automatically in every Omni process through the ``vllm_omni.general_plugins``
entry point, when the package declares it). A connector spec then names it, with our config
keys (or a ``config_file``) in ``extra``; see ``docs/omni.md``.

The framework-free parts import without vllm_omni: :class:`OmniStageStore` (the semantics),
:func:`load_stage_options`, the codec, and :func:`thinker_hidden_states` (the thinker's hidden
states for a KV-cached prefix, from the hidden-state store).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache_async.integration.omni.options import StageOptions, load_stage_options
from lmcache_async.integration.omni.store import OmniStageStore, stage_key

if TYPE_CHECKING:
    from lmcache_async.integration.omni.connector import LMCacheOmniConnector
    from lmcache_async.integration.omni.hidden import thinker_hidden_states

CONNECTOR_NAME = "LMCacheOmniConnector"

_LAZY = {
    "LMCacheOmniConnector": "lmcache_async.integration.omni.connector",
    "thinker_hidden_states": "lmcache_async.integration.omni.hidden",
}


def register() -> None:
    """Register ``LMCacheOmniConnector`` with Omni's ``OmniConnectorFactory`` (idempotent).
    ``ImportError`` where vllm_omni does not import."""
    from lmcache_async.integration.omni.connector import register as _register

    _register()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CONNECTOR_NAME",
    "LMCacheOmniConnector",
    "OmniStageStore",
    "StageOptions",
    "load_stage_options",
    "register",
    "stage_key",
    "thinker_hidden_states",
]
