"""``metrics_port`` in the config: the applications that honour it share one endpoint per
address per process, and a port that cannot be bound never raises."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.metrics import serve_configured_metrics

pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unset_port_serves_nothing() -> None:
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.01)
    with StorageManager(cfg, LMCacheEngineMetadata("m")) as sm:
        assert serve_configured_metrics(sm, cfg) is None


def test_managers_of_one_address_share_one_endpoint() -> None:
    port = _free_port()
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.01, metrics_port=port)
    with (
        StorageManager(cfg, LMCacheEngineMetadata("a"), name="first") as a,
        StorageManager(cfg, LMCacheEngineMetadata("b"), name="second") as b,
    ):
        one = serve_configured_metrics(a, cfg)
        two = serve_configured_metrics(b, cfg)
        assert one is not None and one is two and one.port == port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'cache="first"' in body and 'cache="second"' in body


def test_a_taken_port_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = int(busy.getsockname()[1])
        cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=0.01, metrics_port=port)
        with StorageManager(cfg, LMCacheEngineMetadata("m")) as sm:
            assert serve_configured_metrics(sm, cfg) is None
    assert any("did not start" in r.getMessage() for r in caplog.records)
