"""The optional Prometheus exporter serves the manager's stats."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from lmcache_async.testing import make_key
from lmcache_async.testing.servers import free_port  # outside the outgoing-port range

pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")


def test_metrics_endpoint_reports_tier_figures(make_manager):
    port = free_port()
    sm = make_manager(metrics_port=port)
    sm.put_sync(make_key(1), torch.zeros(16))
    sm.get_sync(make_key(1)).ref_count_down()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'lmcache_async_tier_entries{cache="kv",tier="cpu"} 1.0' in body
    assert 'lmcache_async_tier_hits{cache="kv",tier="cpu"} 1.0' in body
    assert "lmcache_async_pool_used_bytes" in body
