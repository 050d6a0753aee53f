"""Optional Prometheus exporter (``pip install lmcache-async[metrics]``).

``start_metrics_server(port, manager)`` serves the figures of :meth:`StorageManager.stats` as
gauges labelled by cache and tier. Several managers may share one port.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lmcache_async.errors import BackendUnavailableError

if TYPE_CHECKING:
    from lmcache_async.storage_manager import StorageManager

_NUMERIC = (
    "entries",
    "bytes",
    "hits",
    "misses",
    "evictions",
    "errors",
    "timeouts",
    "skipped",
    "writes",
    "write_failures",
)
_servers: dict[int, _Exporter] = {}
_lock = threading.Lock()


class _Exporter:
    def __init__(self, port: int, host: str) -> None:
        try:
            import prometheus_client
            from prometheus_client.core import GaugeMetricFamily
        except ImportError as exc:
            raise BackendUnavailableError(
                "metrics_port is set but prometheus_client is missing: pip install 'lmcache-async[metrics]'"
            ) from exc
        self._gauge = GaugeMetricFamily
        self.managers: weakref.WeakSet[StorageManager] = weakref.WeakSet()
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self)
        self.server, self.thread = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        self.thread.name = f"lmcache-async-metrics-{port}"
        self.port = port

    def collect(self) -> Iterator[Any]:
        fams = {
            name: self._gauge(f"lmcache_async_tier_{name}", f"Tier {name}", labels=["cache", "tier"])
            for name in _NUMERIC
        }
        pool = self._gauge("lmcache_async_pool_used_bytes", "Pool bytes in use", labels=["cache", "pool"])
        for m in list(self.managers):
            st = m.stats()
            for tier, figures in st["tiers"].items():
                for name in _NUMERIC:
                    val = figures.get(name)
                    if isinstance(val, (int, float)):
                        fams[name].add_metric([st["name"], tier], float(val))
            for which in ("pool", "staging"):
                if st[which]:
                    pool.add_metric([st["name"], which], float(st[which]["used_bytes"]))
        yield from fams.values()
        yield pool


class MetricsHandle:
    """Detaches a manager from the exporter on :meth:`close`."""

    def __init__(self, exporter: _Exporter, manager: StorageManager) -> None:
        self._exporter = exporter
        self._manager = weakref.ref(manager)

    @property
    def port(self) -> int:
        return self._exporter.port

    def close(self) -> None:
        m = self._manager()
        if m is not None:
            self._exporter.managers.discard(m)


def start_metrics_server(port: int, manager: StorageManager, host: str = "127.0.0.1") -> MetricsHandle:
    """Serve ``manager``'s stats on ``host:port`` (starting the HTTP server on first use)."""
    with _lock:
        exp = _servers.get(port)
        if exp is None:
            exp = _servers[port] = _Exporter(port, host)
    exp.managers.add(manager)
    return MetricsHandle(exp, manager)
