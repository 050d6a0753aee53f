"""LMCacheECConnectorImpl without vLLM, continued: a promised item is verified once and held
until its load (hold TTL, damaged records, leases for workers in other processes, promises
that cannot be loaded), and ensure_cache_available prefetches lower-tier items without
blocking the step. The vLLM stand-ins come from test_connector_impl.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async.integration.vllm import LMCacheECConnectorImpl

from .helpers import MiB, gib
from .test_connector_impl import Parent, Role, make, request, vllm_config


# ---- verify before the promise, hold until the load -------------------------------------------------
class _Counting:
    """Wraps a manager method and counts its calls."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *a: Any, **k: Any) -> Any:
        self.calls += 1
        return self.fn(*a, **k)


def test_a_promised_item_costs_one_lookup_and_survives_deletion(
    connectors: list[LMCacheECConnectorImpl], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = vllm_config()
    parent = Parent()
    sched = make(connectors, cfg, Role.SCHEDULER)
    worker = make(connectors, cfg, Role.WORKER, parent)
    t = torch.randn(4, 8)
    sched.engine.put("h", t)
    lookups = _Counting(sched._cpu_lookup)
    monkeypatch.setattr(sched, "_cpu_lookup", lookups)
    assert sched.has_cache_item("h")
    sched.update_state_after_alloc(request("h"), 0)
    assert lookups.calls == 1  # the promise reuses the verified entry
    assert sched.engine.delete("h")  # gone from every tier before the worker loads
    parent._connector_metadata = sched.build_connector_meta(None)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    assert torch.equal(encoder_cache["h"], t)
    s = worker.stats()
    assert s["loaded_from_hold"] == 1 and s["load_failures"] == 0


def test_a_hold_nobody_loads_is_released_after_its_ttl(connectors: list[LMCacheECConnectorImpl]) -> None:
    cfg = vllm_config(extra={"max_local_cpu_size": gib(32 * MiB), "hold_ttl_s": 0.0})
    sched = make(connectors, cfg, Role.SCHEDULER)
    make(connectors, cfg, Role.WORKER)
    sched.engine.put("h", torch.ones(4))
    assert sched.has_cache_item("h")
    sched._last_sweep = 0.0
    sched.build_connector_meta(None)
    assert sched.stats()["held"] == 0


def test_a_damaged_record_is_reported_not_cached_and_counted(
    connectors: list[LMCacheECConnectorImpl], tmp_path: Path
) -> None:
    disk = {"local_disk": str(tmp_path / "ec"), "max_local_cpu_size": gib(16 * MiB)}
    producer = make(connectors, vllm_config("ec_producer", {**disk, "chunk_size": 16}), Role.WORKER)
    producer.save_caches({"h": torch.randn(64, 64)}, "h")
    producer.engine.flush(timeout=30)
    (record,) = (tmp_path / "ec").glob("*/*.lmc")
    data = bytearray(record.read_bytes())
    data[-1] ^= 0xFF
    record.write_bytes(bytes(data))
    consumer = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.SCHEDULER)
    assert consumer.has_cache_item("h") is False
    s = consumer.stats()
    assert s["faults"] == 1 and s["misses"] == 1


def test_workers_in_other_processes_load_a_deleted_record_from_its_lease(
    connectors: list[LMCacheECConnectorImpl], tmp_path: Path
) -> None:
    disk = {"local_disk": str(tmp_path / "ec"), "max_local_cpu_size": gib(16 * MiB)}
    producer = make(connectors, vllm_config("ec_producer", {**disk, "chunk_size": 16}), Role.WORKER)
    t = torch.randn(8, 8)
    producer.save_caches({"h": t}, "h")
    producer.engine.flush(timeout=30)
    sched = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.SCHEDULER)
    parent = Parent("ec_consumer")
    worker = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 64}), Role.WORKER, parent)
    assert sched.engine is not worker.engine  # like two processes
    assert sched.has_cache_item("h")
    sched.update_state_after_alloc(request("h"), 0)
    meta = sched.build_connector_meta(None)
    assert set(meta.leases) == {"h"}
    for f in (tmp_path / "ec").glob("*/*.lmc"):
        f.unlink()  # deleted between the promise and the load
    parent._connector_metadata = meta
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    assert torch.equal(encoder_cache["h"], t)
    assert worker.stats()["loaded_from_lease"] == 1
    assert not Path(meta.leases["h"]).exists()  # the worker removed its lease


def test_an_unloadable_promise_fails_its_request_not_the_engine(connectors: list[LMCacheECConnectorImpl]) -> None:
    sched = make(connectors, vllm_config(extra={"max_local_cpu_size": gib(16 * MiB)}), Role.SCHEDULER)
    parent = Parent()
    worker = make(connectors, vllm_config(extra={"max_local_cpu_size": gib(8 * MiB)}), Role.WORKER, parent)
    sched.engine.put("h", torch.ones(3, 5, dtype=torch.float16))
    assert sched.has_cache_item("h")
    sched.update_state_after_alloc(SimpleNamespace(request_id="r7", mm_features=[SimpleNamespace(identifier="h")]), 0)
    sched._handoff.workers = 0  # the worker lives elsewhere and shares no tier
    parent._connector_metadata = sched.build_connector_meta(None)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    placeholder = encoder_cache["h"]  # the step can run...
    assert placeholder.shape == (3, 5) and placeholder.dtype == torch.float16
    report = worker.take_worker_report()
    assert report is not None and report[0] == {"h"}
    sched.update_connector_output(
        SimpleNamespace(ec_connector_worker_meta=SimpleNamespace(failed=report[0], counters=report[1]))
    )
    assert sched.take_unavailable_requests() == {"r7"}  # ...and vLLM fails the request
    assert sched.take_unavailable_requests() == set()
    assert sched.take_stats_delta()["load_failures"] == 1


# ---- ensure_cache_available ---------------------------------------------------------------------------
def _mm_request(rid: str, *hashes: str) -> SimpleNamespace:
    feats = [
        SimpleNamespace(identifier=h, mm_position=SimpleNamespace(offset=4 * i, length=4)) for i, h in enumerate(hashes)
    ]
    return SimpleNamespace(request_id=rid, mm_features=feats)


def _until(pred: Any, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_ensure_promotes_lower_tier_items_without_blocking(
    connectors: list[LMCacheECConnectorImpl], tmp_path: Path
) -> None:
    disk = {"local_disk": str(tmp_path / "ec"), "max_local_cpu_size": gib(16 * MiB)}
    producer = make(connectors, vllm_config("ec_producer", {**disk, "chunk_size": 16}), Role.WORKER)
    producer.save_caches({"a": torch.ones(8)}, "a")
    producer.engine.flush(timeout=30)
    sched = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.SCHEDULER)
    make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.WORKER)  # same process
    req = _mm_request("r", "a", "absent")
    assert sched.ensure_cache_available(req, 0) is False  # promotion queued, request deferred
    assert sched.has_cache_item("a") is False  # never answered from an unfinished promotion
    sched.build_connector_meta(None)  # the end of the step hands the promotions to the loop

    def step() -> bool:
        ready = sched.ensure_cache_available(req, 0)
        sched.build_connector_meta(None)
        return ready

    _until(step)
    assert sched.has_cache_item("a") and not sched.has_cache_item("absent")
    prefetches = sched.stats()["prefetches"]
    assert sched.ensure_cache_available(req, 0)  # settled requests are remembered
    assert sched.stats()["prefetches"] == prefetches == 2
    sched.request_finished(req)


def test_ensure_gives_up_after_the_deadline(
    connectors: list[LMCacheECConnectorImpl], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    cfg = vllm_config(extra={"max_local_cpu_size": gib(16 * MiB), "prefetch_deadline_s": 0.0})
    sched = make(connectors, cfg, Role.SCHEDULER)
    sched._has_lower = True  # as if a slow lower tier might hold it

    async def slow(key: Any, lease: bool) -> tuple[None, str, None]:
        await asyncio.sleep(0.2)
        return None, "absent", None

    monkeypatch.setattr(sched, "_fetch", slow)
    req = _mm_request("r", "h")
    assert sched.ensure_cache_available(req, 0) is False
    sched.build_connector_meta(None)
    assert sched.ensure_cache_available(req, 0) is True  # deadline passed: vLLM encodes it
    assert sched.has_cache_item("h") is False
    assert sched.stats()["prefetch_timeouts"] == 1


def test_items_already_computed_are_not_prefetched(connectors: list[LMCacheECConnectorImpl]) -> None:
    sched = make(connectors, vllm_config(), Role.SCHEDULER)
    sched._has_lower = True
    assert sched.ensure_cache_available(_mm_request("r", "h"), 100) is True
    assert sched.stats()["prefetches"] == 0


def test_producer_only_scheduler_skips_ensure(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config("ec_producer"), Role.SCHEDULER)
    assert c.ensure_cache_available(_mm_request("r", "h"), 0) is True


def test_stats_delta_reports_each_increment_once(connectors: list[LMCacheECConnectorImpl]) -> None:
    c = make(connectors, vllm_config(), Role.SCHEDULER)
    c.has_cache_item("nothing")
    first = c.take_stats_delta()
    assert first["lookups"] == 1 and first["misses"] == 1
    assert c.take_stats_delta() == {}


def test_ensure_leases_on_the_loop_for_workers_in_other_processes(
    connectors: list[LMCacheECConnectorImpl], tmp_path: Path
) -> None:
    disk = {"local_disk": str(tmp_path / "ec"), "max_local_cpu_size": gib(16 * MiB)}
    producer = make(connectors, vllm_config("ec_producer", {**disk, "chunk_size": 16}), Role.WORKER)
    t = torch.randn(4, 4)
    producer.save_caches({"a": t}, "a")
    producer.engine.flush(timeout=30)
    sched = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.SCHEDULER)
    req = _mm_request("r", "a")

    def step() -> bool:
        ready = sched.ensure_cache_available(req, 0)
        sched.build_connector_meta(None)
        return ready

    _until(step)
    assert sched.has_cache_item("a")
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(None)
    assert set(meta.leases) == {"a"} and sched.stats()["leases"] == 1
    for f in (tmp_path / "ec").glob("*/*.lmc"):
        f.unlink()
    parent = Parent("ec_consumer")
    worker = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 64}), Role.WORKER, parent)
    parent._connector_metadata = meta
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    assert torch.equal(encoder_cache["a"], t)


def test_ec_model_name_in_the_extra_config_pins_the_keys(connectors: list[LMCacheECConnectorImpl]) -> None:
    extra = {"max_local_cpu_size": gib(16 * MiB), "ec_model_name": "vl-7b@rev2"}
    a = make(connectors, vllm_config(extra=extra, model="/mnt/a/weights"), Role.WORKER)
    b = make(connectors, vllm_config(extra=dict(extra), model="/mnt/b/weights"), Role.WORKER)
    assert a.engine.key("h").model_name == "vl-7b@rev2"
    assert a.engine is b.engine  # two paths, one identity
