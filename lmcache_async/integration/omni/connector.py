"""``LMCacheOmniConnector``: vLLM-Omni's stage connector interface over :class:`OmniStageStore`.

Importing this module imports vllm_omni (its ``OmniConnectorBase``); the rest of the package
does not. Omni builds connectors through ``OmniConnectorFactory`` by name, so the class is
registered there by :func:`register` (see :mod:`lmcache_async.integration.omni`).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

from lmcache_async.integration.omni.options import load_stage_options
from lmcache_async.integration.omni.store import OmniStageStore

__all__ = ["CONNECTOR_NAME", "LMCacheOmniConnector", "register"]

CONNECTOR_NAME = "LMCacheOmniConnector"
"""The name a connector spec uses (``name: LMCacheOmniConnector``)."""

_register_lock = threading.Lock()
_registered = False


class LMCacheOmniConnector(OmniConnectorBase):
    """An Omni stage connector whose payloads live in lmcache_async's tiers.

    ``config`` is the connector spec's ``extra`` dict: engine config keys inline and/or a
    ``config_file``, plus the connector's own keys
    (:data:`~lmcache_async.integration.omni.options.CONNECTOR_DEFAULTS`); see
    :func:`~lmcache_async.integration.omni.options.load_stage_options`. Semantics of every
    method: :class:`~lmcache_async.integration.omni.store.OmniStageStore`. Tensors are carried
    raw (``supports_raw_data``); other payloads as pickle-free records.
    """

    supports_raw_data: bool = True
    _store: OmniStageStore | None = None

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        engine_config, options = load_stage_options(config)
        self.config = dict(config or {})
        self.stage_id = self.config.get("stage_id", -1)
        self._store = OmniStageStore(engine_config, options)

    @property
    def store(self) -> OmniStageStore:
        """The store behind this connector."""
        assert self._store is not None
        return self._store

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        return self.store.put(from_stage, to_stage, put_key, data)

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> tuple[Any, int] | None:
        return self.store.get(from_stage, to_stage, get_key, metadata)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        return self.store.get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=deadline)

    def cleanup(self, request_id: str) -> None:
        self.store.cleanup(request_id)

    def reap_consumed(self) -> None:
        if self._store is not None:
            self._store.reap_consumed()

    def health(self) -> dict[str, Any]:
        if self._store is None:
            return {"status": "unhealthy", "error": "not initialised"}
        return self._store.health()

    def close(self) -> None:
        """Close the store (idempotent; also run by Omni's ``__del__``/``with``)."""
        if self._store is not None:
            self._store.close()


def _create(config: dict[str, Any]) -> OmniConnectorBase:
    return LMCacheOmniConnector(config)


def register() -> None:
    """Register :class:`LMCacheOmniConnector` with ``OmniConnectorFactory`` under
    :data:`CONNECTOR_NAME`. Idempotent (Omni loads plugins once per process, possibly more);
    ``ValueError`` when another connector already took the name."""
    global _registered
    with _register_lock:
        if _registered:
            return
        OmniConnectorFactory.register_connector(CONNECTOR_NAME, _create)
        _registered = True
