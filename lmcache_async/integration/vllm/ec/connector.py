"""The class vLLM loads: ``LMCacheECConnector``, a subclass of vLLM's ``ECConnectorBase``.

Load it with::

    --ec-transfer-config '{"ec_connector": "LMCacheECConnector",
                           "ec_connector_module_path": "lmcache_async.integration.vllm",
                           "ec_role": "ec_both"}'

Every method delegates to :class:`~lmcache_async.integration.vllm.ec.impl.LMCacheECConnectorImpl`
(see there for the behaviour); this module only binds it to vLLM's types: the connector
metadata, the worker → scheduler report, the EC connector stats and the Prometheus metrics.
Importing it imports vLLM; ``import lmcache_async`` and ``import lmcache_async.integration.vllm``
do not. Our log records go to vLLM's log handlers when the application configured none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from lmcache_async.integration.vllm.ec.impl import COUNTERS, ECLoadMetadata, LMCacheECConnectorImpl

try:  # vLLM >= 0.32
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM has no worker -> scheduler report

    class ECConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in base on vLLM releases without worker metadata."""

        def aggregate(self, other: Any) -> Any:
            raise NotImplementedError


try:  # vLLM >= 0.32
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorPromMetrics,
        ECConnectorStats,
    )

    _HAS_STATS_API = True
except ImportError:  # pragma: no cover - older vLLM has no EC stats API
    _HAS_STATS_API = False

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "LMCacheECConnector",
    "LMCacheECConnectorMetadata",
    "LMCacheECWorkerMetadata",
]

PROM_COUNTERS: dict[str, str] = {
    "hits": "Encoder-cache items vLLM did not encode because the cache held them.",
    "misses": "Encoder-cache lookups answered 'not cached' (vLLM encoded the item).",
    "faults": "Cached items found damaged, missing or on a failing tier before a promise (encoded instead).",
    "load_failures": "Promised items a worker could not load (their requests were failed).",
    "prefetches": "Promotions of lower-tier items started by ensure_cache_available.",
    "prefetch_timeouts": "Promotions given up after the prefetch deadline (items encoded).",
    "deferred": "Times a request was deferred by a step while its items were promoted.",
    "loaded": "Encoder outputs loaded into vLLM's encoder cache.",
    "loaded_bytes": "Bytes of encoder outputs loaded into vLLM's encoder cache.",
    "saved": "Encoder outputs stored in the cache.",
    "saved_bytes": "Bytes of encoder outputs stored in the cache.",
    "unavailable_requests": "Requests failed because a promised item could not be loaded.",
    "errors": "Failures inside the connector (counted, logged, never raised into vLLM).",
}
"""Counters exported as ``vllm:lmcache_ec_<name>`` (Prometheus appends ``_total``)."""


def _bridge_logs() -> None:
    """Send our records to vLLM's handlers when nothing else would show them."""
    ours = logging.getLogger("lmcache_async")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


_bridge_logs()


@dataclass
class LMCacheECConnectorMetadata(ECConnectorMetadata, ECLoadMetadata):
    """Scheduler → worker: the ``mm_hashes`` (sorted) to load this step, their disk leases and
    recorded shapes."""


@dataclass
class LMCacheECWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker → scheduler, once per step: hashes that failed to load and counter increments."""

    failed: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """The union of failures and the sum of counters of two workers' reports."""
        if not isinstance(other, LMCacheECWorkerMetadata):
            return self
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        return LMCacheECWorkerMetadata(failed=self.failed | other.failed, counters=counters)


_stats_cls: Any = None
_prom_cls: Any = None

if _HAS_STATS_API:

    @dataclass
    class LMCacheECConnectorStats(ECConnectorStats):
        """Counter increments over one interval (``data``: counter name → count)."""

        def reset(self) -> None:
            self.data.clear()

        def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
            merged = dict(self.data)
            for k, v in (other.data or {}).items():
                if isinstance(v, (int, float)):
                    merged[k] = merged.get(k, 0) + v
            return LMCacheECConnectorStats(data=merged)

        def reduce(self) -> dict[str, int | float]:
            return {k: v for k, v in sorted(self.data.items()) if isinstance(v, (int, float)) and v}

        def is_empty(self) -> bool:
            return not any(self.data.values())

    class LMCacheECPromMetrics(ECConnectorPromMetrics):
        """``vllm:lmcache_ec_*`` counters, one child per engine."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters: dict[str, dict[int, Any]] = {}
            for name, doc in PROM_COUNTERS.items():
                metric = self._counter_cls(name=f"vllm:lmcache_ec_{name}", documentation=doc, labelnames=labelnames)
                self._counters[name] = {
                    idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()
                }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, per_engine in self._counters.items():
                value = transfer_stats_data.get(name)
                child = per_engine.get(engine_idx)
                if child is not None and isinstance(value, (int, float)) and value > 0:
                    child.inc(value)

    _stats_cls = LMCacheECConnectorStats
    _prom_cls = LMCacheECPromMetrics


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

    def build_connector_worker_meta(self) -> Any:
        """This step's failed loads and counter increments (None when nothing is new)."""
        report = self._impl.take_worker_report()
        if report is None:
            return None
        failed, counters = report
        return LMCacheECWorkerMetadata(failed=failed, counters=counters)

    # ---- scheduler side -------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self._impl.has_cache_item(identifier)

    def has_caches(self, request: Any) -> list[bool]:
        """vLLM 0.11.1-0.14 spelling of the lookup: one flag per multimodal item."""
        return self._impl.has_caches(request)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int = 0, *args: Any, **kwargs: Any) -> bool:
        return self._impl.ensure_cache_available(request, num_computed_tokens, *args, **kwargs)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self._impl.update_state_after_alloc(request, index)

    def update_state_after_free(self, request: Any, index: int) -> None:
        self._impl.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        meta = self._impl.build_connector_meta(scheduler_output)
        assert isinstance(meta, LMCacheECConnectorMetadata)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._impl.update_connector_output(connector_output)

    def take_unavailable_requests(self) -> set[str]:
        return self._impl.take_unavailable_requests()

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished(request)

    # ---- stats ----------------------------------------------------------------------------------
    def get_ec_connector_stats(self) -> Any:
        """Counter increments since the last call (this connector's and its workers')."""
        if _stats_cls is None:  # pragma: no cover
            return None
        delta = self._impl.take_stats_delta()
        return _stats_cls(data=delta) if delta else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if _stats_cls is None:  # pragma: no cover
            return None
        return _stats_cls(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        if _prom_cls is None:  # pragma: no cover
            return None
        return _prom_cls(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._impl.close()

    def get_stats(self) -> dict[str, Any]:
        """Connector and engine counters."""
        return self._impl.stats()


assert set(PROM_COUNTERS) <= set(COUNTERS)
