"""Optional Prometheus exporter (``pip install lmcache-async[metrics]``), started by the application.

``serve_metrics(managers, port=...)`` serves the figures of :meth:`StorageManager.stats` of the
managers it is given, labelled by cache and tier. A manager never starts a server by itself: the
application picks the managers (the KV engine's, the hidden-state store's, ...) and the port.

Monotonic figures are Prometheus counters (exposed with the ``_total`` suffix); levels are gauges:

========================================  =======  ==========================================
name                                      type     figure
========================================  =======  ==========================================
``lmcache_async_tier_entries``            gauge    entries a tier holds
``lmcache_async_tier_bytes``              gauge    bytes a tier holds
``lmcache_async_tier_<c>_total``          counter  ``<c>`` in hits, misses, evictions, errors,
                                                   timeouts, skipped, writes, write_failures
``lmcache_async_pool_used_bytes``         gauge    pool / staging bytes in use
``lmcache_async_pending_writes``          gauge    write-throughs not finished
``lmcache_async_put_rejected_total``      counter  puts refused (also ``put_too_large_total``,
                                                   ``one_off_refused_total``)
========================================  =======  ==========================================

A manager that is closed (or collected) drops out of the figures; the server keeps no manager
alive (weak references).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from lmcache_async.errors import BackendUnavailableError

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.storage_manager import StorageManager

__all__ = ["COUNTERS", "GAUGES", "MetricsServer", "serve_configured_metrics", "serve_metrics"]

logger = logging.getLogger(__name__)

#: Per-tier figures that only grow (counters).
COUNTERS = ("hits", "misses", "evictions", "errors", "timeouts", "skipped", "writes", "write_failures")
#: Per-tier levels (gauges).
GAUGES = ("entries", "bytes")
_MANAGER_COUNTERS = ("put_rejected", "put_too_large", "one_off_refused")


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise BackendUnavailableError(
            "serving metrics needs prometheus_client: pip install 'lmcache-async[metrics]'"
        ) from exc
    return prometheus_client


class _Collector:
    """Builds the metric families from the managers' stats at each scrape (scrape thread)."""

    def __init__(self) -> None:
        self.managers: weakref.WeakSet[StorageManager] = weakref.WeakSet()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["cache", "tier"]
        gauges = {n: GaugeMetricFamily(f"lmcache_async_tier_{n}", f"Tier {n}", labels=labels) for n in GAUGES}
        counters = {n: CounterMetricFamily(f"lmcache_async_tier_{n}", f"Tier {n}", labels=labels) for n in COUNTERS}
        pool = GaugeMetricFamily("lmcache_async_pool_used_bytes", "Pool bytes in use", labels=["cache", "pool"])
        pending = GaugeMetricFamily("lmcache_async_pending_writes", "Write-throughs not finished", labels=["cache"])
        refused = {
            n: CounterMetricFamily(f"lmcache_async_{n}", n.replace("_", " ").capitalize(), labels=["cache"])
            for n in _MANAGER_COUNTERS
        }
        for m in list(self.managers):
            if m.closed:
                continue
            st = m.stats()
            cache = st["name"]
            for tier, figures in st["tiers"].items():
                for fams in (gauges, counters):
                    for name, fam in fams.items():
                        val = figures.get(name)
                        if isinstance(val, (int, float)):
                            fam.add_metric([cache, tier], float(val))
            for which in ("pool", "staging"):
                if st[which]:
                    pool.add_metric([cache, which], float(st[which]["used_bytes"]))
            pending.add_metric([cache], float(st["pending_writes"]))
            for name, fam in refused.items():
                fam.add_metric([cache], float(st[name]))
        yield from gauges.values()
        yield from counters.values()
        yield pool
        yield pending
        yield from refused.values()


class MetricsServer:
    """One HTTP endpoint serving ``/metrics`` for a set of managers (held weakly).

    :meth:`add`/:meth:`discard` change the set from any thread; :meth:`close` stops the server
    and joins its thread (bounded). Also a context manager."""

    def __init__(self, port: int, host: str) -> None:
        prometheus_client = _prometheus()
        self._collector = _Collector()
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self._collector)
        self._server, self._thread = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port: int = self._server.server_port
        self._thread.name = f"lmcache-async-metrics-{self.port}"
        self._lock = threading.Lock()
        self._closed = False

    def add(self, manager: StorageManager) -> None:
        """Serve ``manager``'s figures too."""
        self._collector.managers.add(manager)

    def discard(self, manager: StorageManager) -> None:
        """Stop serving ``manager``'s figures (no error when it was not served)."""
        self._collector.managers.discard(manager)

    def close(self, join_timeout: float = 5.0) -> None:
        """Stop the HTTP server and release its port. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(join_timeout)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer(host={self.host!r}, port={self.port}, closed={self._closed})"


def serve_metrics(managers: Iterable[StorageManager], port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Start a Prometheus endpoint on ``host:port`` serving ``managers`` (``port=0``: a free
    port, see :attr:`MetricsServer.port`). Blocking only while the socket binds; the server runs
    on its own daemon thread. Raises ``ValueError`` for a port outside 0..65535, ``TypeError``
    for something that is not a StorageManager, :class:`BackendUnavailableError` without
    ``prometheus_client``, ``OSError`` when the port is taken."""
    from lmcache_async.storage_manager import StorageManager

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    chosen = list(managers)
    for i, m in enumerate(chosen):
        if not isinstance(m, StorageManager):
            raise TypeError(f"managers[{i}] must be a StorageManager, got {type(m).__name__}")
    server = MetricsServer(port, host)
    for m in chosen:
        server.add(m)
    return server


_config_servers: dict[tuple[str, int], MetricsServer] = {}
_config_servers_lock = threading.Lock()


def serve_configured_metrics(manager: StorageManager, config: LMCacheEngineConfig) -> MetricsServer | None:
    """For applications that honour the ``metrics_port``/``metrics_host`` config keys (the vLLM
    connectors, ``lmcache-async serve``): add ``manager`` to this process's endpoint on that
    address, starting it on first use. Every manager of one process configured with the same
    address shares one endpoint.

    Returns the endpoint, or ``None`` when ``metrics_port`` is unset or the endpoint cannot start
    (``prometheus_client`` missing, the port taken): that is logged once per address and never
    raised, so a serving engine does not fail over its metrics.
    """
    port = config.metrics_port
    if port is None:
        return None
    addr = (config.metrics_host, port)
    with _config_servers_lock:
        server = _config_servers.get(addr)
        if server is None:
            try:
                server = serve_metrics([], port=port, host=config.metrics_host)
            except Exception as exc:
                _config_servers_failed(addr, exc)
                return None
            _config_servers[addr] = server
    server.add(manager)
    return server


_failed_addrs: set[tuple[str, int]] = set()


def _config_servers_failed(addr: tuple[str, int], exc: BaseException) -> None:
    if addr not in _failed_addrs:
        _failed_addrs.add(addr)
        logger.warning("metrics endpoint on %s:%d did not start: %s", addr[0], addr[1], exc)
