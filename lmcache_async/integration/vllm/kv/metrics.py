"""Prometheus figures of the KV connector's load-or-recompute decisions.

:class:`SchedulerMetrics` is a ``prometheus_client`` collector the scheduler-side connector
registers with its store's exporter when ``metrics_port`` is set (beside the manager's tier
figures). At each scrape (the exporter's thread) it reads the scheduler side's counters and
estimates:

==============================================  =======  =====================================
name                                            type     figure
==============================================  =======  =====================================
``lmcache_async_kv_connector_total``            counter  per ``counter``: lookups, decisions
                                                         (``decision_<reason>``), tokens
                                                         loaded and declined, failed loads …
``lmcache_async_kv_prefill_tokens_per_second``  gauge    the engine's measured prefill rate
``lmcache_async_kv_tier_read_latency_seconds``  gauge    per tier: the fitted read latency
``lmcache_async_kv_tier_read_bytes_per_second`` gauge    per tier: the fitted read bandwidth
``lmcache_async_kv_lookup_hook_seconds``        gauge    ``get_num_new_matched_tokens`` call
                                                         time, per ``quantile`` (0.5, 0.99)
==============================================  =======  =====================================
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide

__all__ = ["SchedulerMetrics"]


class SchedulerMetrics:
    """The collector over one scheduler side (held weakly: a dropped side yields nothing)."""

    def __init__(self, side: KVSchedulerSide) -> None:
        self._side = weakref.ref(side)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        side = self._side()
        if side is None:
            return
        stats = side.stats()
        total = CounterMetricFamily("lmcache_async_kv_connector", "KV connector scheduler counters", labels=["counter"])
        for name, value in stats.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total.add_metric([name], float(value))
        yield total
        costs = stats.get("costs") or {}
        rate = costs.get("prefill_tokens_per_s")
        prefill = GaugeMetricFamily("lmcache_async_kv_prefill_tokens_per_second", "Measured prefill rate")
        if rate is not None:
            prefill.add_metric([], float(rate))
        yield prefill
        latency = GaugeMetricFamily(
            "lmcache_async_kv_tier_read_latency_seconds", "Fitted read latency", labels=["tier"]
        )
        bandwidth = GaugeMetricFamily(
            "lmcache_async_kv_tier_read_bytes_per_second", "Fitted read bandwidth", labels=["tier"]
        )
        for tier, fit in (costs.get("tiers") or {}).items():
            latency.add_metric([tier], float(fit["latency_s"]))
            if math.isfinite(fit["bytes_per_s"]):
                bandwidth.add_metric([tier], float(fit["bytes_per_s"]))
        yield latency
        yield bandwidth
        hook = GaugeMetricFamily("lmcache_async_kv_lookup_hook_seconds", "Lookup hook call time", labels=["quantile"])
        times = stats.get("hook_s") or {}
        for q, key in (("0.5", "p50"), ("0.99", "p99")):
            if key in times:
                hook.add_metric([q], float(times[key]))
        yield hook
