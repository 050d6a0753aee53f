"""The encoder-cache connector on the ``server`` tier only: promises backed by server holds."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async.integration.vllm.ec.impl import LMCacheECConnectorImpl
from lmcache_async.server.client import ServerClient
from lmcache_async.server.leases import LEASE_PREFIX, ServerHolds


class Role(enum.Enum):  # the shape of vLLM's ECConnectorRole
    SCHEDULER = 0
    WORKER = 1


class Parent:
    """The parts of vLLM's ECConnectorBase the connector reads."""

    def __init__(self, ec_role: str) -> None:
        self.is_producer = ec_role in ("ec_producer", "ec_both")
        self.is_consumer = ec_role in ("ec_consumer", "ec_both")
        self._connector_metadata: Any = None


def _vllm_config(ec_role: str, extra: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        ec_transfer_config=SimpleNamespace(ec_role=ec_role, ec_connector_extra_config=extra),
        model_config=SimpleNamespace(model="org/vl-model", served_model_name=None, dtype=torch.float16),
        device_config=SimpleNamespace(device=torch.device("cpu"), device_type="cpu"),
    )


def _request(*hashes: str) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", mm_features=[SimpleNamespace(identifier=h) for h in hashes])


@pytest.fixture
def connectors() -> Iterator[list[LMCacheECConnectorImpl]]:
    made: list[LMCacheECConnectorImpl] = []
    yield made
    for c in made:
        c.close()


@pytest.fixture
def server(make_server):
    return make_server().start()


def _extra(srv, **more: Any) -> dict[str, Any]:
    return {
        "tier_order": ["server"],
        "cache_server_socket": srv.socket,
        "cache_server_namespace": "ec",
        "remote_timeout_s": 5.0,
        **more,
    }


def _make(made: list[LMCacheECConnectorImpl], role_name: str, role: Role, extra: dict[str, Any]) -> Any:
    parent = Parent(role_name)
    c = LMCacheECConnectorImpl(_vllm_config(role_name, extra), role, parent)
    made.append(c)
    return c, parent


def _promise(sched: LMCacheECConnectorImpl, mm_hash: str) -> Any:
    assert sched.has_cache_item(mm_hash)
    sched.update_state_after_alloc(_request(mm_hash), 0)
    return sched.build_connector_meta(None)


def test_a_promise_to_a_worker_elsewhere_is_a_server_hold_that_survives_deletion(server, connectors) -> None:
    producer, _ = _make(connectors, "ec_producer", Role.WORKER, _extra(server, chunk_size=16))
    t = torch.randn(8, 8).to(torch.float16)
    producer.save_caches({"h": t}, "h")
    producer.engine.flush(timeout=30)
    # Different configs: separate engines, as in separate processes (no hand-off between them).
    sched, _ = _make(connectors, "ec_consumer", Role.SCHEDULER, _extra(server, chunk_size=32))
    worker, parent = _make(connectors, "ec_consumer", Role.WORKER, _extra(server, chunk_size=64))
    assert sched.engine is not worker.engine
    assert sched.engine.storage_manager.tier_names == ["server"]
    assert isinstance(sched._leases, ServerHolds)
    meta = _promise(sched, "h")
    assert set(meta.leases) == {"h"} and meta.leases["h"].startswith(LEASE_PREFIX)
    assert server.status()["namespaces"]["ec"]["holds"] == 1
    other = ServerClient(server.socket, "ec", timeout_s=5.0)
    assert other.remove([sched.engine.key("h").to_string().encode()]) == [True]  # between promise and load
    other.close()
    parent._connector_metadata = meta
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert torch.equal(cache["h"], t)
    st = worker.stats()
    assert st["loaded_from_lease"] == 1 and st["load_failures"] == 0
    assert server.status()["namespaces"]["ec"]["holds"] == 0  # the worker dropped the hold
    assert sched.stats()["leases"] == 1


def test_an_unused_promise_hold_is_dropped_when_its_hold_is_released(server, connectors) -> None:
    producer, _ = _make(connectors, "ec_producer", Role.WORKER, _extra(server, chunk_size=16))
    producer.save_caches({"u": torch.ones(4, 4, dtype=torch.float16)}, "u")
    producer.engine.flush(timeout=30)
    sched, _ = _make(connectors, "ec_consumer", Role.SCHEDULER, _extra(server, chunk_size=32))
    assert sched.has_cache_item("u")  # held for a load that never comes
    assert server.status()["namespaces"]["ec"]["holds"] == 1
    sched.close()
    assert server.status()["namespaces"]["ec"]["holds"] == 0


def test_a_hold_lost_with_a_server_restart_fails_the_request_not_the_engine(server, connectors) -> None:
    producer, _ = _make(connectors, "ec_producer", Role.WORKER, _extra(server, chunk_size=16))
    producer.save_caches({"r": torch.ones(4, 4, dtype=torch.float16)}, "r")
    producer.engine.flush(timeout=30)
    sched, _ = _make(connectors, "ec_consumer", Role.SCHEDULER, _extra(server, chunk_size=32))
    worker, parent = _make(connectors, "ec_consumer", Role.WORKER, _extra(server, chunk_size=64))
    meta = _promise(sched, "r")
    server.kill()
    server.start()
    parent._connector_metadata = meta
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert worker.stats()["load_failures"] == 1
    assert cache["r"].shape == (4, 4)  # a placeholder so the step runs
    report = worker.take_worker_report()
    assert report is not None and report[0] == {"r"}


def test_a_disk_tier_keeps_disk_leases(server, connectors, tmp_path) -> None:
    extra = {**_extra(server), "tier_order": ["disk", "server"], "local_disk": str(tmp_path / "ec")}
    sched, _ = _make(connectors, "ec_consumer", Role.SCHEDULER, extra)
    assert not isinstance(sched._leases, ServerHolds)
