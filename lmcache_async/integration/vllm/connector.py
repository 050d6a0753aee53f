"""The class vLLM loads: ``LMCacheECConnector``, a subclass of vLLM's ``ECConnectorBase``.

Load it with::

    --ec-transfer-config '{"ec_connector": "LMCacheECConnector",
                           "ec_connector_module_path": "lmcache_async.integration.vllm",
                           "ec_role": "ec_both"}'

Every method delegates to :class:`~lmcache_async.integration.vllm.impl.LMCacheECConnectorImpl`
(see there for the behaviour); this module only binds it to vLLM's types. Importing it imports
vLLM; ``import lmcache_async`` and ``import lmcache_async.integration.vllm`` do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from lmcache_async.integration.vllm.impl import ECLoadMetadata, LMCacheECConnectorImpl

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["LMCacheECConnector", "LMCacheECConnectorMetadata"]


@dataclass
class LMCacheECConnectorMetadata(ECConnectorMetadata, ECLoadMetadata):
    """Scheduler → worker: the ``mm_hashes`` (sorted) to load this step."""


class LMCacheECConnector(ECConnectorBase):
    """vLLM encoder-cache connector backed by lmcache_async's encoder cache."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self._impl = LMCacheECConnectorImpl(vllm_config, role, self, metadata_cls=LMCacheECConnectorMetadata)

    @property
    def impl(self) -> LMCacheECConnectorImpl:
        """The framework-free implementation (engine, counters)."""
        return self._impl

    # ---- worker side ----------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._impl.start_load_caches(encoder_cache, **kwargs)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        self._impl.save_caches(encoder_cache, mm_hash, **kwargs)

    # ---- scheduler side -------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self._impl.has_cache_item(identifier)

    def has_caches(self, request: Any) -> list[bool]:
        """vLLM 0.11.1-0.14 spelling of the lookup: one flag per multimodal item."""
        return self._impl.has_caches(request)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self._impl.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        meta = self._impl.build_connector_meta(scheduler_output)
        assert isinstance(meta, LMCacheECConnectorMetadata)
        return meta

    # ---- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._impl.close()

    def get_stats(self) -> dict[str, Any]:
        """Connector and engine counters."""
        return self._impl.stats()
