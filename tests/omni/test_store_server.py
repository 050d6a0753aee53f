"""OmniStageStore over the node server alone: one-copy puts, reads into payload buffers, inline polls."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from omni.conftest import server_extra
from server.conftest import ServerProcess

from lmcache_async.integration.omni import OmniStageStore
from lmcache_async.integration.omni.options import StageOptions

Make = Callable[..., OmniStageStore]
MiB = 1 << 20


def _server(store: OmniStageStore) -> dict[str, Any]:
    figures: dict[str, Any] = store.manager.stats()["tiers"]["server"]
    return figures


def test_a_tensor_put_is_written_straight_into_the_server(make_store: Make, cache_server: ServerProcess) -> None:
    s = make_store(**server_extra(cache_server))
    ok, size, _ = s.put("thinker", "talker", "r1_0_0", torch.randn(MiB))
    assert ok and size == 4 * MiB
    assert _server(s)["direct_puts"] == 1 and s.manager.stats()["pending_writes"] == 0


def test_a_dict_put_is_written_straight_into_the_server(make_store: Make, cache_server: ServerProcess) -> None:
    s = make_store(**server_extra(cache_server))
    assert s.put("thinker", "talker", "r1_0_0", {"h": torch.randn(MiB), "ids": [1, 2]})[0]
    assert _server(s)["direct_puts"] == 1


def test_a_received_tensor_lives_in_the_payload_buffers_until_it_is_freed(
    make_store: Make, cache_server: ServerProcess
) -> None:
    producer = make_store(**server_extra(cache_server))
    consumer = make_store(**server_extra(cache_server), payload_buffer_size=1 / 64)
    value = torch.randn(MiB).to(torch.bfloat16)
    assert producer.put("thinker", "talker", "r1_0_0", value)[0]
    got = consumer.get("thinker", "talker", "r1_0_0")
    assert got is not None and torch.equal(got[0], value) and got[0].dtype == torch.bfloat16
    bufs = consumer.health()["payload_buffers"]
    assert bufs["pooled"] == 1 and bufs["free"] == bufs["capacity"] - 2 * MiB
    del got
    gc.collect()
    assert consumer.health()["payload_buffers"]["free"] == bufs["capacity"]


def test_a_received_dict_holds_its_tensors_in_the_payload_buffers(
    make_store: Make, cache_server: ServerProcess
) -> None:
    producer = make_store(**server_extra(cache_server))
    consumer = make_store(**server_extra(cache_server), payload_buffer_size=1 / 64)
    tree: dict[str, Any] = {"hidden": torch.randn(MiB // 2), "ids": list(range(8))}
    assert producer.put("thinker", "talker", "r2_0_0", tree)[0]
    got = consumer.get("thinker", "talker", "r2_0_0")
    assert got is not None
    out = got[0]
    assert torch.equal(out["hidden"], tree["hidden"]) and out["ids"] == tree["ids"]
    del got
    free = consumer.health()["payload_buffers"]["free"]
    del out
    gc.collect()
    assert consumer.health()["payload_buffers"]["free"] > free


def _record_fetch_threads(store: OmniStageStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    fetch = store._fetch

    def recording(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return fetch(*args)

    monkeypatch.setattr(store, "_fetch", recording)
    return names


def test_a_poll_far_from_its_deadline_runs_on_the_callers_thread(
    make_store: Make, cache_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = make_store(**server_extra(cache_server))
    consumer = make_store(**server_extra(cache_server))
    assert producer.put("thinker", "talker", "r3_0_0", torch.ones(64))[0]
    names = _record_fetch_threads(consumer, monkeypatch)
    got = consumer.get_with_deadline("thinker", "talker", "r3_0_0", deadline=time.monotonic() + 30)
    assert got is not None and torch.equal(got[0], torch.ones(64))
    assert names == [threading.current_thread().name]


def test_a_poll_closer_to_its_deadline_than_the_tiers_bound_runs_on_a_worker(
    make_store: Make, cache_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = make_store(**server_extra(cache_server))
    consumer = make_store(**server_extra(cache_server))  # remote_timeout_s 2 s
    assert producer.put("thinker", "talker", "r4_0_0", torch.ones(64))[0]
    names = _record_fetch_threads(consumer, monkeypatch)
    got = consumer.get_with_deadline("thinker", "talker", "r4_0_0", deadline=time.monotonic() + 1)
    assert got is not None
    assert len(names) == 1 and names[0].startswith("lmcache-async-omni")


def test_payload_buffer_size_is_checked() -> None:
    with pytest.raises(ValueError, match="payload_buffer_size"):
        StageOptions(payload_buffer_size=-1)
    with pytest.raises(TypeError, match="payload_buffer_size"):
        StageOptions(payload_buffer_size="1")  # type: ignore[arg-type]
