"""The KV connector's event wiring (:mod:`lmcache_async.integration.vllm.kv.event_reports`): a
worker's reports from a real StorageManager (CPU tier at once, disk once its file is there,
removals from the manager's removal listeners), the scheduler's descriptions from a request's
vLLM block hashes, and the rank count before a chunk is published.

Needs vLLM (its ``KVConnectorKVEvents`` and hash helpers): run in the e2e or vLLM venv; skipped
elsewhere."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="needs vLLM (the e2e or vLLM venv)")
    from lmcache_async.integration.vllm.kv.event_reports import (
        LMCacheKVReports,
        SchedulerEvents,
        WorkerEventReports,
    )

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

BLOCK, CHUNK = 4, 8


def _request(tokens: list[int], lora: str | None = None) -> Any:
    hashes = [bytes([i % 256]) * 32 for i in range(len(tokens) // BLOCK)]
    lr = SimpleNamespace(lora_name=lora, name=lora, lora_path="/x", adapter_id=1) if lora else None
    return SimpleNamespace(
        block_hashes=hashes, all_token_ids=tokens, lora_request=lr, mm_features=[], cache_salt=None,
        prompt_embeds=None,
    )  # fmt: skip


@pytest.fixture
def manager(tmp_path: Path) -> Any:
    cfg = LMCacheEngineConfig(
        chunk_size=CHUNK, max_local_cpu_size=0.01, local_disk=str(tmp_path / "d"), max_local_disk_size=0.1
    )
    meta = LMCacheEngineMetadata(model_name="m", kv_dtype=torch.float32)
    sm = StorageManager(cfg, meta)
    yield sm, ChunkedTokenDatabase(CHUNK, False, meta)
    sm.close_sync()


def test_worker_reports_cpu_at_once_disk_when_durable_and_removals(manager: Any) -> None:
    sm, db = manager
    rep = WorkerEventReports(sm, rank=0)
    sm.removals.add(rep.tier_removed)
    keys = db.make_keys([11, 12])
    ok = sm.batched_put_sync(keys, [torch.ones(2, 8), torch.ones(2, 8)])
    rep.saved(keys, ok)
    first = rep.take()
    assert ("stored", "cpu", 11, 0) in first and ("stored", "cpu", 12, 0) in first
    sm.flush_sync()
    deadline = time.monotonic() + 20
    got: list[Any] = list(first)  # a fast write-through may be durable by the first take already
    while len([r for r in got if r[1] == "disk"]) < 2 and time.monotonic() < deadline:
        got += rep.take()
        time.sleep(0.02)
    assert {r for r in got if r[1] == "disk"} == {("stored", "disk", 11, 0), ("stored", "disk", 12, 0)}, (
        got, [sm.tier_holds("disk", k) for k in keys], rep.counters, dict(rep._watch), sm.stats()["tiers"]["disk"]
    )  # fmt: skip
    sm.remove_sync(keys[0])
    removed = rep.take()
    assert ("removed", "cpu", 11, 0) in removed and ("removed", "disk", 11, 0) in removed


def test_scheduler_describes_chunks_from_vllm_hashes_and_publishes_parent_first() -> None:
    ev = SchedulerEvents(world_size=1, block_size=BLOCK, chunk_size=CHUNK)
    tokens = list(range(100, 124))
    ev.track("r", _request(tokens, lora="ad"))
    ev.planned("r", [7, 8, 9], 0, 3)
    ev.apply(LMCacheKVReports([("stored", "disk", 9, 0), ("stored", "disk", 8, 0)]))
    assert ev.take_events() == []  # children wait for their parent
    ev.apply(LMCacheKVReports([("stored", "disk", 7, 0), ("stored", "cpu", 7, 0)]))
    out = ev.take_events()
    disk = [e for e in out if e.ownership == "lmcache_async:disk"]
    assert [e.token_ids for e in disk] == [tokens[0:8], tokens[8:16], tokens[16:24]]
    assert disk[1].parent_block_hash == disk[0].block_hashes[-1] and disk[0].parent_block_hash is None
    assert all(e.medium == "STORAGE" and e.lora_name == "ad" and e.block_size == BLOCK for e in disk)
    assert disk[0].extra_keys == [("ad",), ("ad",)]  # as vLLM publishes a LoRA block's keys
    assert [e.medium for e in out if e.ownership == "lmcache_async:cpu"] == ["CPU"]
    ev.apply(LMCacheKVReports([("removed", "disk", 8, 0)]))
    gone = ev.take_events()
    assert [e.block_hashes for e in gone] == [disk[2].block_hashes, disk[1].block_hashes]  # leaves first


def test_a_chunk_is_published_once_every_rank_holds_it_and_a_lookup_miss_withdraws_it() -> None:
    ev = SchedulerEvents(world_size=2, block_size=BLOCK, chunk_size=CHUNK)
    ev.track("r", _request(list(range(8))))
    ev.planned("r", [5], 0, 1)
    ev.apply(LMCacheKVReports([("stored", "disk", 5, 0)]))
    assert ev.take_events() == []
    ev.apply(LMCacheKVReports([("stored", "disk", 5, 1)]))
    assert [type(e).__name__ for e in ev.take_events()] == ["BlockStored"]
    ev.looked_up([5], ["disk"], {"disk": True})
    assert ev.take_events() == []
    ev.looked_up([5], [None], {"disk": False})  # the tier could not answer: kept
    assert ev.take_events() == []
    ev.looked_up([5], [None], {"disk": True})
    assert [type(e).__name__ for e in ev.take_events()] == ["BlockRemoved"]
    assert ev.stats()["vanished"] == 1


def test_unknown_reports_and_undescribed_chunks_change_nothing() -> None:
    ev = SchedulerEvents(world_size=1, block_size=BLOCK, chunk_size=CHUNK)
    ev.apply(LMCacheKVReports([("stored", "disk", 1, 0), ("removed", "cpu", 2, 0), ("bad",)]))  # type: ignore[list-item]
    ev.apply(object())
    short = _request(list(range(4)))  # vLLM has hashed one block only
    ev.track("s", short)
    ev.planned("s", [3], 0, 1)
    assert ev.take_events() == [] and ev.stats()["undescribed"] == 1 and ev.stats()["errors"] == 1


def test_chunks_on_the_server_tier_are_described_to_the_server(make_event_server: type, tmp_path: Path) -> None:
    from lmcache_async.events.subscriber import EventSubscriber
    from lmcache_async.events.wire import BlockStored
    from lmcache_async.integration.vllm.kv.event_reports import ServerDescriber

    srv = make_event_server().start()
    sub = EventSubscriber(srv.endpoint, srv.replay_endpoint)
    sub.snapshot()
    cfg = LMCacheEngineConfig(
        chunk_size=CHUNK, tier_order=["server"], cache_server_socket=srv.socket, cache_server_namespace="events"
    )
    meta = LMCacheEngineMetadata(model_name="m", kv_dtype=torch.float32)
    sm = StorageManager(cfg, meta)
    db = ChunkedTokenDatabase(CHUNK, False, meta)
    describer = ServerDescriber(lambda: sm, db.make_key, world_size=1)
    ev = SchedulerEvents(world_size=1, block_size=BLOCK, chunk_size=CHUNK, describe_server=describer)
    try:
        assert sm.batched_put_sync(db.make_keys([41, 42]), [torch.ones(2, 8), torch.ones(2, 8)]) == [True, True]
        ev.track("r", _request(list(range(16))))
        ev.planned("r", [41, 42], 0, 2)
        ev.apply(LMCacheKVReports([("stored", "server", 41, 0), ("stored", "server", 42, 0)]))
        ours = [e for e in ev.take_events() if e.ownership == "lmcache_async:server"]
        deadline = time.monotonic() + 10
        seen: list[Any] = []
        while len(seen) < 2 and time.monotonic() < deadline:
            st = srv.status()["events"]
            seen += [e for b in sub.catch_up(st["next_seq"]) for e in b.events if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in seen] == [e.block_hashes for e in ours]  # the same chunks, both streams
        assert describer.counters["recorded"] == 2
    finally:
        describer.close()
        sub.close()
        sm.close_sync()
