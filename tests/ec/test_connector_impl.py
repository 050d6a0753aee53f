"""LMCacheECConnectorImpl without vLLM: the objects vLLM hands the connector are plain
attribute bags here (the real-vLLM test is in tests/vllm). Storage is real. Promises, holds
and ensure_cache_available are in test_connector_impl_promises.py, which shares the stand-ins
defined here."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async import ConfigError, ManagerClosedError
from lmcache_async.integration.vllm import (
    ECLoadMetadata,
    LMCacheECConnectorImpl,
    load_connector_config,
)
from lmcache_async.integration.vllm.ec.impl import (
    DEFAULT_ENCODER_DTYPE,
    DEFAULT_MODEL_NAME,
    item_identifier,
    model_identity,
    worker_device,
)

from .helpers import MiB, gib


class Role(enum.Enum):  # the shape of vLLM's ECConnectorRole
    SCHEDULER = 0
    WORKER = 1


def vllm_config(
    ec_role: str = "ec_both",
    extra: dict[str, Any] | None = None,
    *,
    model: str | None = "org/vl-model",
    served: Any = None,
    dtype: Any = torch.float16,
    device: str = "cpu",
    model_config: bool = True,
) -> SimpleNamespace:
    if extra is None:
        extra = {"max_local_cpu_size": gib(32 * MiB), "staging_size": gib(4 * MiB)}
    mc = SimpleNamespace(model=model, served_model_name=served, dtype=dtype) if model_config else None
    return SimpleNamespace(
        ec_transfer_config=SimpleNamespace(ec_role=ec_role, ec_connector_extra_config=extra),
        model_config=mc,
        device_config=SimpleNamespace(device=torch.device(device), device_type=device),
    )


class Parent:
    """The parts of vLLM's ECConnectorBase the implementation reads."""

    def __init__(self, ec_role: str = "ec_both") -> None:
        self.is_producer = ec_role in ("ec_producer", "ec_both")
        self.is_consumer = ec_role in ("ec_consumer", "ec_both")
        self._connector_metadata: Any = None


def request(*hashes: str, attr: str = "identifier") -> SimpleNamespace:
    feats = [SimpleNamespace(**{attr: h}) for h in hashes]
    return SimpleNamespace(request_id="r", mm_features=feats)


def make(
    made: list[LMCacheECConnectorImpl], cfg: SimpleNamespace, role: Any, parent: Parent | None = None
) -> LMCacheECConnectorImpl:
    c = LMCacheECConnectorImpl(cfg, role, parent if parent is not None else Parent(cfg.ec_transfer_config.ec_role))
    made.append(c)
    return c


# ---- reading vLLM objects --------------------------------------------------------------------------
def test_item_identifier_prefers_identifier_then_mm_hash_then_mm_hashes() -> None:
    assert item_identifier(request("a", "b"), 1) == "b"
    both = SimpleNamespace(mm_features=[SimpleNamespace(identifier="id", mm_hash="mh")])
    assert item_identifier(both, 0) == "id"
    assert item_identifier(request("x", attr="mm_hash"), 0) == "x"
    old = SimpleNamespace(mm_hashes=["h0", "h1"])
    assert item_identifier(old, 1) == "h1"
    with pytest.raises(ValueError, match="index 3"):
        item_identifier(old, 3)


def test_model_identity_uses_the_model_not_the_served_alias() -> None:
    assert model_identity(vllm_config(served="served-a")) == ("org/vl-model", torch.float16)
    assert model_identity(vllm_config(served=["first", "second"])) == ("org/vl-model", torch.float16)
    assert model_identity(vllm_config(served=None, dtype="bfloat16")) == ("org/vl-model", torch.bfloat16)


def test_model_identity_is_pinned_by_ec_model_name() -> None:
    assert model_identity(vllm_config(), "pinned") == ("pinned", torch.float16)
    assert model_identity(vllm_config(model_config=False), "pinned")[0] == "pinned"


def test_model_identity_falls_back_without_a_model_config(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert model_identity(vllm_config(model_config=False)) == (DEFAULT_MODEL_NAME, DEFAULT_ENCODER_DTYPE)
        assert model_identity(vllm_config(model=None, dtype=None)) == (DEFAULT_MODEL_NAME, DEFAULT_ENCODER_DTYPE)
        assert model_identity(vllm_config(dtype="not-a-dtype"))[1] == DEFAULT_ENCODER_DTYPE


def test_worker_device_comes_from_the_device_config() -> None:
    assert worker_device(vllm_config(device="cpu")) == torch.device("cpu")
    assert worker_device(SimpleNamespace()) == torch.device("cpu")
    assert worker_device(SimpleNamespace(device_config=SimpleNamespace(device="bogus"))) == torch.device("cpu")


# ---- configuration ---------------------------------------------------------------------------------
def test_inline_extra_config_keys_build_the_engine_config() -> None:
    cfg = load_connector_config({"max_local_cpu_size": 0.5, "ec_chunk_size": 128, "ec": {"staging_size": 0.01}})
    assert cfg.max_local_cpu_size == 0.5
    assert cfg.chunk_size == 128 and cfg.staging_size == 0.01


def test_extra_config_file_is_the_base_with_its_ec_overlay(tmp_path: Path) -> None:
    path = tmp_path / "lmc.yaml"
    path.write_text("max_local_cpu_size: 3.0\nchunk_size: 64\nec_max_local_cpu_size: 0.25\n")
    cfg = load_connector_config({"config_file": str(path), "chunk_size": 32})
    assert cfg.max_local_cpu_size == 0.25  # the file's EC overlay
    assert cfg.chunk_size == 32  # inline beats the file's base key


def test_env_config_file_and_ec_env_overlay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lmc.yaml"
    path.write_text("local_disk: /tmp/should-be-overridden\nmax_local_cpu_size: 2\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", str(tmp_path / "ec-disk"))
    cfg = load_connector_config({})
    assert cfg.local_disk == str(tmp_path / "ec-disk")
    assert cfg.max_local_disk_size == 64.0  # EC default when a disk path is set
    assert cfg.max_local_cpu_size == 2.0


def test_ec_defaults_apply_without_any_config() -> None:
    cfg = load_connector_config(None)
    assert cfg.local_cpu and cfg.max_local_cpu_size == 1.0
    assert cfg.local_disk is None  # no disk path is ever invented


def test_bad_inline_values_raise_and_unknown_keys_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        load_connector_config({"max_local_cpu_size": "lots"})
    with caplog.at_level(logging.WARNING):
        load_connector_config({"no_such_key": 1})
    assert "no_such_key" in caplog.text
    with pytest.raises(TypeError, match="config_file"):
        load_connector_config({"config_file": 12})


def test_missing_ec_transfer_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="ec_transfer_config"):
        LMCacheECConnectorImpl(SimpleNamespace(ec_transfer_config=None), Role.WORKER, Parent())


# ---- engine sharing ------------------------------------------------------------------------------
def test_scheduler_and_worker_connectors_in_one_process_share_one_engine(
    connectors: list[LMCacheECConnectorImpl],
) -> None:
    cfg = vllm_config()
    sched = make(connectors, cfg, Role.SCHEDULER)
    worker = make(connectors, cfg, Role.WORKER)
    assert sched.engine is worker.engine
    assert (sched.role, worker.role) == ("scheduler", "worker")
    sched.close()
    assert not worker.engine.closed  # still used by the worker
    worker.close()
    assert worker.engine.closed
    worker.close()  # idempotent


def test_connectors_with_different_configs_get_different_engines(
    connectors: list[LMCacheECConnectorImpl],
) -> None:
    a = make(connectors, vllm_config(), Role.WORKER)
    b = make(connectors, vllm_config(extra={"max_local_cpu_size": gib(16 * MiB)}), Role.WORKER)
    c = make(connectors, vllm_config(model="another"), Role.WORKER)
    d = make(connectors, vllm_config(served="alias"), Role.WORKER)
    assert a.engine is not b.engine and a.engine is not c.engine
    assert d.engine is a.engine  # the served alias does not change the keys


def test_engine_uses_model_name_and_dtype_from_vllm(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config(model="vis-7b", dtype=torch.float16), Role.WORKER)
    key = c.engine.key("h")
    assert key.model_name == "vis-7b" and key.dtype == torch.float16
    assert (key.world_size, key.worker_id) == (1, 0)


# ---- the step: scheduler -> worker ------------------------------------------------------------------
def test_producer_save_then_consumer_load_round_trip(connectors: list[LMCacheECConnectorImpl]) -> None:
    cfg = vllm_config()
    parent = Parent()
    sched = make(connectors, cfg, Role.SCHEDULER)
    worker = make(connectors, cfg, Role.WORKER, parent)
    t1, t2 = torch.randn(16, 32, dtype=torch.float16), torch.randn(4, 32, dtype=torch.float16)
    produced = {"img-b": t1, "img-a": t2}
    worker.save_caches(produced, "img-b")
    worker.save_caches(produced, "img-a")
    assert sched.has_cache_item("img-a") and sched.has_cache_item("img-b")
    assert not sched.has_cache_item("img-c")
    req = request("img-b", "img-c", "img-a")
    for i in range(3):
        sched.update_state_after_alloc(req, i)
    meta = sched.build_connector_meta(SimpleNamespace())
    assert isinstance(meta, ECLoadMetadata)
    assert meta.mm_hashes == ["img-a", "img-b"]  # sorted; img-c is computed, not loaded
    assert sched.build_connector_meta(SimpleNamespace()).mm_hashes == []  # drained
    parent._connector_metadata = meta
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    assert set(encoder_cache) == {"img-a", "img-b"}
    assert torch.equal(encoder_cache["img-b"], t1) and encoder_cache["img-b"].dtype == torch.float16
    assert torch.equal(encoder_cache["img-a"], t2)
    assert encoder_cache["img-a"].device.type == "cpu"
    s = worker.stats()
    assert s["saved"] == 2 and s["loaded"] == 2 and s["errors"] == 0


def test_has_caches_answers_per_item_for_older_vllm(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config(), Role.SCHEDULER)
    c.engine.put("b", torch.ones(2))
    assert c.has_caches(request("a", "b", "c")) == [False, True, False]
    assert c.has_caches(SimpleNamespace(mm_hashes=["b", "z"])) == [True, False]
    assert c.has_caches(SimpleNamespace()) == []


def test_old_request_fields_are_read_for_loads(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config(), Role.SCHEDULER)
    c.engine.put("h1", torch.ones(2))
    old = SimpleNamespace(mm_hashes=["h0", "h1"])
    assert c.has_caches(old) == [False, True]  # vLLM 0.11.x asks per request, then allocates
    c.update_state_after_alloc(old, 1)
    assert c.has_cache_item("h1")
    c.update_state_after_alloc(request("h1", attr="mm_hash"), 0)
    assert c.build_connector_meta(None).mm_hashes == ["h1"]


def test_start_load_never_overwrites_what_vllm_holds(connectors: list[LMCacheECConnectorImpl]) -> None:
    parent = Parent()
    c = make(connectors, vllm_config(), Role.WORKER, parent)
    c.engine.put("h", torch.zeros(3))
    mine = torch.ones(3)
    encoder_cache = {"h": mine}
    parent._connector_metadata = ECLoadMetadata(["h"])
    c.start_load_caches(encoder_cache)
    assert encoder_cache["h"] is mine
    assert c.stats()["load_skipped_present"] == 1


def test_start_load_counts_misses_and_leaves_them_out(connectors: list[LMCacheECConnectorImpl]) -> None:
    parent = Parent()
    c = make(connectors, vllm_config(), Role.WORKER, parent)
    parent._connector_metadata = ECLoadMetadata(["gone"])
    encoder_cache: dict[str, torch.Tensor] = {}
    c.start_load_caches(encoder_cache)
    assert encoder_cache == {} and c.stats()["load_failures"] == 1  # no recorded shape: nothing to stand in


def test_start_load_without_metadata_is_a_no_op(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config(), Role.WORKER, Parent())
    encoder_cache: dict[str, torch.Tensor] = {}
    c.start_load_caches(encoder_cache)
    assert encoder_cache == {}
    orphan = make(connectors, vllm_config(), Role.WORKER)
    orphan._parent = None
    orphan.start_load_caches(encoder_cache)


def test_start_load_with_wrong_metadata_type_raises(connectors: list[LMCacheECConnectorImpl]) -> None:
    parent = Parent()
    c = make(connectors, vllm_config(), Role.WORKER, parent)
    parent._connector_metadata = SimpleNamespace(mm_hashes=["h"])
    with pytest.raises(TypeError, match="metadata"):
        c.start_load_caches({})


def test_metadata_can_be_passed_as_keyword(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config(), Role.WORKER, Parent())
    c.engine.put("h", torch.full((2,), 5.0))
    encoder_cache: dict[str, torch.Tensor] = {}
    c.start_load_caches(encoder_cache, metadata=ECLoadMetadata(["h"]))
    assert torch.equal(encoder_cache["h"], torch.full((2,), 5.0))


def test_save_only_when_producer(connectors: list[LMCacheECConnectorImpl]) -> None:
    consumer = make(connectors, vllm_config("ec_consumer"), Role.WORKER)
    consumer.save_caches({"h": torch.ones(2)}, "h")
    assert not consumer.engine.contains("h")
    assert consumer.stats()["saved"] == 0
    producer = make(connectors, vllm_config("ec_producer"), Role.WORKER)
    producer.save_caches({"h": torch.ones(2)}, "h")
    assert producer.engine.contains("h")
    producer.save_caches({}, "missing")  # nothing to save: skipped, no error
    assert producer.stats()["save_skipped"] == 1


def test_producer_only_scheduler_queues_no_loads(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config("ec_producer"), Role.SCHEDULER)
    c.engine.put("h", torch.ones(1))
    assert c.has_cache_item("h")  # a producer may skip encoding what is cached
    c.update_state_after_alloc(request("h"), 0)
    assert c.build_connector_meta(None).mm_hashes == []


def test_roles_fall_back_to_ec_role_without_parent_flags(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = LMCacheECConnectorImpl(vllm_config("ec_consumer"), "worker", SimpleNamespace())
    connectors.append(c)
    assert (c.is_producer, c.is_consumer) == (False, True)


# ---- failures never raise into the step ---------------------------------------------------------------
def test_failures_inside_the_connector_count_and_log(
    connectors: list[LMCacheECConnectorImpl], caplog: pytest.LogCaptureFixture
) -> None:
    parent = Parent()
    c = make(connectors, vllm_config(), Role.WORKER, parent)
    with caplog.at_level(logging.WARNING):
        c.save_caches({"h": "not a tensor"}, "h")  # type: ignore[dict-item]
        assert c.has_cache_item(None) is False  # type: ignore[arg-type]
        c.update_state_after_alloc(SimpleNamespace(), 0)
        assert c.has_caches(SimpleNamespace(mm_features=[SimpleNamespace()])) == [False]
    s = c.stats()
    assert s["errors"] == 4
    assert set(s["errors_by_op"]) == {"save_caches", "has_cache_item", "update_state_after_alloc", "has_caches"}
    assert "save_caches failed" in caplog.text


def test_a_closed_engine_does_not_raise_into_the_step(connectors: list[LMCacheECConnectorImpl]) -> None:
    parent = Parent()
    c = make(connectors, vllm_config(), Role.WORKER, parent)
    c.engine.close()
    c.save_caches({"h": torch.ones(1)}, "h")
    assert c.has_cache_item("h") is False
    parent._connector_metadata = ECLoadMetadata(["h"])
    encoder_cache: dict[str, torch.Tensor] = {}
    c.start_load_caches(encoder_cache)
    assert encoder_cache == {}
    assert c.stats()["errors"] == 2  # the save and the load; the lookup is a plain miss
    with pytest.raises(ManagerClosedError):
        c.engine.contains("h")


def test_error_logging_is_rate_limited(
    connectors: list[LMCacheECConnectorImpl], caplog: pytest.LogCaptureFixture
) -> None:
    c = make(connectors, vllm_config(), Role.WORKER)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            c.save_caches({"h": 1}, "h")  # type: ignore[dict-item]
    assert caplog.text.count("save_caches failed") == 1
    assert c.stats()["errors_by_op"]["save_caches"] == 50


def test_connectors_of_separate_configs_share_through_a_disk_dir(
    connectors: list[LMCacheECConnectorImpl], tmp_path: Path
) -> None:
    disk = {"local_disk": str(tmp_path / "ec"), "max_local_cpu_size": gib(16 * MiB)}
    producer = make(connectors, vllm_config("ec_producer", {**disk, "chunk_size": 16}), Role.WORKER)
    consumer_parent = Parent("ec_consumer")
    consumer = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.WORKER, consumer_parent)
    assert producer.engine is not consumer.engine
    t = torch.randn(8, 8)
    producer.save_caches({"h": t}, "h")
    producer.engine.flush(timeout=30)
    assert consumer.has_cache_item("h")
    consumer_parent._connector_metadata = ECLoadMetadata(["h"])
    encoder_cache: dict[str, torch.Tensor] = {}
    consumer.start_load_caches(encoder_cache)
    assert torch.equal(encoder_cache["h"], t)


# ---- imports ---------------------------------------------------------------------------------------------
def test_importing_the_package_does_not_import_vllm() -> None:
    code = (
        "import sys, lmcache_async, lmcache_async.integration.vllm as v\n"
        "from lmcache_async import ECCacheEngine\n"
        "assert v.LMCacheECConnectorImpl\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_attribute_of_the_package_raises() -> None:
    import lmcache_async.integration.vllm as v

    with pytest.raises(AttributeError):
        v.NoSuchThing  # noqa: B018


def test_release_of_a_replaced_engine_leaves_the_new_engine_open(connectors) -> None:
    cfg = vllm_config()
    a = make(connectors, cfg, Role.WORKER)
    a.engine.close()  # closed behind the connectors' back: the next one gets a fresh engine
    b = make(connectors, cfg, Role.SCHEDULER)
    assert b.engine is not a.engine and not b.engine.closed
    a.close()
    assert not b.engine.closed
    b.close()
    assert b.engine.closed


# ---- roles without vLLM ------------------------------------------------------------------------------
def test_roles_read_each_parent_flag_on_its_own(connectors: list[LMCacheECConnectorImpl]) -> None:
    only_producer_flag = SimpleNamespace(is_producer=False)  # no is_consumer attribute at all
    c = LMCacheECConnectorImpl(vllm_config("ec_both"), "worker", only_producer_flag)
    connectors.append(c)
    assert (c.is_producer, c.is_consumer) == (False, True)
