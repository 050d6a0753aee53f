"""``LMCacheKVHiddenStatesConnector``: the KV connector for engines that extract hidden states.

vLLM's speculative method ``extract_hidden_states`` keeps the hidden states of the layers named
by ``eagle_aux_hidden_state_layer_ids`` in a KV-cache group of their own (a
``CacheOnlyAttentionLayer``, spec ``HiddenStateCacheSpec``). That needs vLLM's hybrid KV-cache
manager, which vLLM keeps on only for connectors that declare ``SupportsHMA`` (as
:class:`~.kv_connector.LMCacheKVConnector` does). This subclass stores that group through the
connector's hidden-state store (:mod:`.kv_hs_group`): the hidden states of every saved chunk are
stored (and published to the KV tiers) beside its KV, and a restored KV prefix gets its hidden
states back into the group's blocks, prefix-strict. Load it with::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                           "draft_model_config": {"hf_config":
                               {"eagle_aux_hidden_state_layer_ids": [0, 3]}}}'
    --kv-transfer-config '{"kv_connector": "LMCacheKVHiddenStatesConnector",
                           "kv_connector_module_path": "lmcache_async.integration.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"enable_hidden_state_cache": true}}'

The hidden-state layer shares the attention group's block ids when vLLM keeps one group (every
attention layer of one kind); with several groups (e.g. full and sliding-window attention) it has
a group of its own, possibly with a smaller block size, and the attention groups are the parts of
each KV record (:mod:`.kv_groups`). Failures are then reported by request, and a chunk's KV is
never restored without its hidden states (the request is recomputed instead).
``connector.load_hidden_states(token_ids, layer_idx)`` gives a restored or stored prefix's hidden
states for an aux layer to any caller.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_async.integration.vllm.kv.connector import LMCacheKVConnector
from lmcache_async.integration.vllm.kv.groups import NULL_BLOCK_ID, describe_groups
from lmcache_async.integration.vllm.kv.hs_group import HiddenStateGroup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

__all__ = ["LMCacheKVHiddenStatesConnector", "hidden_state_group_ids"]


def _is_hidden_state_spec(spec: Any) -> bool:
    return any(cls.__name__ == "HiddenStateCacheSpec" for cls in type(spec).__mro__)


def hidden_state_group_ids(kv_cache_config: Any) -> tuple[int, int]:
    """``(primary attention group index, hidden-state group index)`` of vLLM's KV-cache groups.

    The hidden-state layer (``HiddenStateCacheSpec``) joins the attention group when vLLM keeps
    one group (both indexes 0, shared block ids); with several groups it has one of its own.
    ``ValueError`` for a layout without exactly one hidden-state group beside attention, or
    with groups the connector cannot restore."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    layout = describe_groups(kv_cache_config)
    hs = [i for i, g in enumerate(groups) if _is_hidden_state_spec(g.kv_cache_spec)]
    if len(groups) == 1 and not layout.unsupported:
        return 0, 0
    if len(hs) == 1 and not layout.unsupported and layout.hidden == hs[0]:
        return layout.attention[0], hs[0]
    raise ValueError(
        f"LMCacheKVHiddenStatesConnector needs attention KV-cache groups and one hidden-state group; "
        f"this engine has {[type(g.kv_cache_spec).__name__ for g in groups]}"
        + (f" (cannot restore {', '.join(layout.unsupported)})" if layout.unsupported else "")
    )


def _aux_layer_ids(vllm_config: Any) -> list[int]:
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    ids = getattr(getattr(draft, "hf_config", None), "eagle_aux_hidden_state_layer_ids", None)
    if getattr(spec, "method", None) != "extract_hidden_states" or not ids:
        raise ValueError(
            "LMCacheKVHiddenStatesConnector needs the speculative method extract_hidden_states with "
            "eagle_aux_hidden_state_layer_ids in its draft_model_config"
        )
    return [int(i) for i in ids]


class LMCacheKVHiddenStatesConnector(LMCacheKVConnector):
    """:class:`LMCacheKVConnector` plus vLLM's hidden-state group; see the module docstring.

    ``ValueError`` at construction without ``enable_hidden_state_cache``, without the
    ``extract_hidden_states`` speculative method, or with another group layout."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if not self._config.enable_hidden_state_cache:
            raise ValueError("LMCacheKVHiddenStatesConnector needs enable_hidden_state_cache: true")
        self.aux_layer_ids = _aux_layer_ids(vllm_config)
        allowed = self._config.hidden_state_layers
        if allowed is not None and not set(self.aux_layer_ids) <= set(allowed):
            raise ValueError(f"hidden_state_layers {allowed} must include the extracted layers {self.aux_layer_ids}")
        if self.scheduler_side is not None:
            kv_group, hs_group = hidden_state_group_ids(kv_cache_config)
            self.scheduler_side.kv_group = kv_group
            self.scheduler_side.hs_group = hs_group
            self.scheduler_side.hs_layer_ids = tuple(self.aux_layer_ids)
        if self.worker_side is not None:
            self.worker_side.hs = self.store.hidden_state_store

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The attention layers become the KV records' layers, the ``CacheOnlyAttentionLayer``
        the hidden-state group (``ValueError`` unless there is exactly one)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        hs_names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(hs_names) != 1:
            raise ValueError(f"expected one CacheOnlyAttentionLayer among the KV caches, found {hs_names}")
        logger.info("LMCacheKVHiddenStatesConnector: %s is %s", hs_names[0], tuple(kv_caches[hs_names[0]].shape))
        group = HiddenStateGroup(kv_caches[hs_names[0]], self.aux_layer_ids)
        attention = {name: t for name, t in kv_caches.items() if name != hs_names[0]}
        layers, parts = self._record_layers(attention)
        null = NULL_BLOCK_ID if self.groups.several or self.groups.windowed else None
        caches = self._worker().register(layers, group, layer_parts=parts, null_block=null)
        logger.info(
            "LMCacheKVHiddenStatesConnector: %d KV layers (record %s), hidden-state group %s for layers %s",
            caches.num_layers,
            caches.record_shape,
            tuple(group.cache.shape),
            group.layer_ids,
        )
