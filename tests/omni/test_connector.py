"""LMCacheOmniConnector against vLLM-Omni's real classes: registration, creation from a spec
(and from Omni's own transfer config), the OmniConnectorBase surface, deadlines that bound
every blocking receive (also against a hung node server)."""

from __future__ import annotations

import dataclasses
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from omni.conftest import SMALL, server_extra
from server.conftest import ServerProcess

pytestmark = pytest.mark.usefixtures("omni")

# The contract is deadline + 50 ms (the bench measures that); this margin is CI-safe.
DEADLINE_MARGIN_S = 1.0


def make(extra: dict[str, Any]) -> Any:
    from vllm_omni.distributed.omni_connectors import ConnectorSpec, OmniConnectorFactory

    from lmcache_async.integration.omni import CONNECTOR_NAME, register

    register()
    return OmniConnectorFactory.create_connector(ConnectorSpec(name=CONNECTOR_NAME, extra=extra))


@pytest.fixture
def connector() -> Any:
    conn = make(dict(SMALL))
    yield conn
    conn.close()


def test_register_adds_the_name_to_the_factory_and_is_idempotent() -> None:
    from vllm_omni.distributed.omni_connectors import OmniConnectorFactory

    from lmcache_async.integration.omni import CONNECTOR_NAME, register

    register()
    register()
    assert CONNECTOR_NAME in OmniConnectorFactory.list_registered_connectors()


def test_factory_builds_the_connector_from_a_spec_with_extra(tmp_path: Path) -> None:
    from vllm_omni.distributed.omni_connectors import OmniConnectorBase

    from lmcache_async.integration.omni import LMCacheOmniConnector

    conn = make({**SMALL, "local_disk": str(tmp_path), "max_local_disk_size": 0.05, "stage_id": 1, "role": "sender"})
    try:
        assert isinstance(conn, LMCacheOmniConnector) and isinstance(conn, OmniConnectorBase)
        assert conn.supports_raw_data is True
        assert conn.store.manager.tier_names == ["cpu", "disk"]
        assert conn.stage_id == 1
    finally:
        conn.close()


def test_factory_builds_the_connector_from_a_config_file(tmp_path: Path) -> None:
    f = tmp_path / "lmcache.yaml"
    f.write_text(f"max_local_cpu_size: 0.03125\nlocal_disk: {tmp_path / 'd'}\nmax_local_disk_size: 0.05\n")
    conn = make({"config_file": str(f), "namespace": "tts"})
    try:
        assert conn.store.manager.tier_names == ["cpu", "disk"]
        assert conn.store.options.namespace == "tts"
    finally:
        conn.close()


def test_a_bad_extra_fails_creation_with_the_factorys_value_error() -> None:
    with pytest.raises(ValueError, match="serializer"):
        make({**SMALL, "serializer": "pickle"})


def test_omni_transfer_config_names_the_connector_for_an_edge() -> None:
    from vllm_omni.distributed.omni_connectors import OmniConnectorFactory, load_omni_transfer_config

    from lmcache_async.integration.omni import register

    register()
    cfg = load_omni_transfer_config(
        config_dict={
            "runtime": {"connectors": {"lmc": {"name": "LMCacheOmniConnector", "extra": dict(SMALL)}}},
            "stage_args": [
                {"stage_id": 0, "output_connectors": {"to_stage_1": "lmc"}},
                {"stage_id": 1, "input_connectors": {"from_stage_0": "lmc"}},
            ],
        }
    )
    assert cfg is not None
    spec = cfg.get_connector_for_edge("0", "1")
    assert spec is not None and spec.name == "LMCacheOmniConnector"
    conn = OmniConnectorFactory.create_connector(spec)
    try:
        assert conn.put("0", "1", "r_0_0", {"x": torch.ones(3)})[0]
        got = conn.get("0", "1", "r_0_0")
        assert got is not None and torch.equal(got[0]["x"], torch.ones(3))
    finally:
        conn.close()


def test_put_returns_ok_size_and_metadata_and_get_returns_payload_and_size(connector: Any) -> None:
    t = torch.randn(64, 32)
    ok, size, meta = connector.put("thinker", "talker", "r1_0_0", t)
    assert ok and size == 64 * 32 * 4 and isinstance(meta, dict)
    got = connector.get("thinker", "talker", "r1_0_0", meta)
    assert got is not None and torch.equal(got[0], t) and got[1] == size


def test_omni_serializer_carries_types_the_tree_codec_cannot(connector: Any) -> None:
    @dataclasses.dataclass
    class StageInfo:
        stage: int
        tokens: list[int]

    assert connector.put("a", "b", "dc", {"info": StageInfo(2, [1, 2])})[0]
    got = connector.get("a", "b", "dc")
    assert got is not None and got[0] == {"info": {"stage": 2, "tokens": [1, 2]}}  # Omni decodes dataclasses as dicts


def test_serializer_omni_round_trips_tensors() -> None:
    conn = make({**SMALL, "serializer": "omni"})
    try:
        t = torch.randn(5, 5)
        assert conn.put("a", "b", "k", {"t": t, "n": 3})[0]
        got = conn.get("a", "b", "k")
        assert got is not None and torch.equal(got[0]["t"], t) and got[0]["n"] == 3
    finally:
        conn.close()


def test_cleanup_removes_what_put_wrote(connector: Any) -> None:
    connector.put("0", "1", "rq_0_0", torch.ones(2))
    connector.put("0", "1", "rq_0_1", torch.ones(2))
    connector.cleanup("rq")
    assert connector.get("0", "1", "rq_0_0") is None and connector.get("0", "1", "rq_0_1") is None


def test_health_is_healthy_then_closed_and_close_is_idempotent() -> None:
    conn = make(dict(SMALL))
    assert conn.health()["status"] == "healthy"
    conn.close()
    conn.close()
    assert conn.health()["status"] == "closed"


def test_connector_works_as_a_context_manager() -> None:
    with make(dict(SMALL)) as conn:
        assert conn.put("a", "b", "k", torch.ones(1))[0]
    assert conn.health()["status"] == "closed"


def test_get_with_deadline_bounds_a_receive_nobody_writes(cache_server: ServerProcess) -> None:
    conn = make(server_extra(cache_server))
    try:
        deadline = time.monotonic() + 0.5
        assert conn.get_with_deadline("thinker", "talker", f"never-{uuid.uuid4().hex}", None, deadline=deadline) is None
        assert time.monotonic() < deadline + DEADLINE_MARGIN_S
    finally:
        conn.close()


def test_get_with_deadline_bounds_a_receive_from_a_hung_node_server(cache_server: ServerProcess) -> None:
    conn = make({**server_extra(cache_server), "remote_timeout_s": 30.0, "blocking_timeout_secs": 60})
    try:
        assert conn.put("a", "b", "warm", torch.ones(4))[0]
        cache_server.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            deadline = time.monotonic() + 0.5
            assert conn.get_with_deadline("a", "b", "warm", None, deadline=deadline) is None
            assert time.monotonic() < deadline + DEADLINE_MARGIN_S
        finally:
            cache_server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    finally:
        conn.close()
