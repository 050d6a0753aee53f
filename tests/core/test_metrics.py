"""The Prometheus exporter the application starts over the managers it picks."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.metrics import serve_metrics
from lmcache_async.testing import make_key

pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_metrics_endpoint_reports_tier_figures(make_manager):
    sm = make_manager()
    sm.put_sync(make_key(1), torch.zeros(16))
    sm.get_sync(make_key(1)).ref_count_down()
    with serve_metrics([sm], port=0) as server:
        body = _scrape(server.port)
    assert 'lmcache_async_tier_entries{cache="kv",tier="cpu"} 1.0' in body
    assert 'lmcache_async_tier_hits_total{cache="kv",tier="cpu"} 1.0' in body
    assert "lmcache_async_pool_used_bytes" in body


def test_monotonic_figures_are_counters_and_levels_gauges(make_manager):
    sm = make_manager()
    with serve_metrics([sm]) as server:
        body = _scrape(server.port)
    for counter in ("tier_hits", "tier_evictions", "tier_write_failures", "put_rejected"):
        # the TYPE line names the family with or without _total, by prometheus_client version
        assert re.search(rf"# TYPE lmcache_async_{counter}(_total)? counter", body), counter
    assert "# TYPE lmcache_async_tier_entries gauge" in body
    assert "# TYPE lmcache_async_pending_writes gauge" in body


def test_only_the_managers_given_are_served_and_closed_ones_drop_out(small_config, metadata):
    with (
        StorageManager(small_config(), metadata, name="a") as a,
        StorageManager(small_config(), metadata, name="b") as b,
        serve_metrics([a]) as server,
    ):
        body = _scrape(server.port)
        assert 'cache="a"' in body and 'cache="b"' not in body
        server.add(b)
        assert 'cache="b"' in _scrape(server.port)
        b.close_sync()
        assert 'cache="b"' not in _scrape(server.port)


def test_close_releases_the_port(make_manager):
    sm = make_manager()
    server = serve_metrics([sm])
    port = server.port
    server.close()
    server.close()
    with serve_metrics([sm], port=port) as again:  # the same port binds again
        assert again.port == port


@pytest.mark.parametrize("port", [-1, 65536, "80", True])
def test_serve_metrics_checks_the_port(make_manager, port):
    with pytest.raises(ValueError, match="port"):
        serve_metrics([make_manager()], port=port)


def test_serve_metrics_checks_the_managers():
    with pytest.raises(TypeError, match=r"managers\[0\]"):
        serve_metrics([object()])  # type: ignore[list-item]
