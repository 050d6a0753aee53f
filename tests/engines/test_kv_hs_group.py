"""vLLM's hidden-state KV-cache group through the KV connector's halves (no vLLM needed).

The group's cache is ``[num_blocks, num_aux_layers, block_size, hidden]``; the scheduler plans
its rows with the KV (per-group block ids, as vLLM's hybrid manager hands them), the worker
stores them through the hidden-state store and restores them, prefix-strict, in another store
on the same disk directory (a new engine process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmcache_async.disk.layout import entry_path, key_digest
from lmcache_async.engines.hidden_states import hs_entry_key
from lmcache_async.integration.vllm.kv.hs_group import HiddenStateGroup
from lmcache_async.integration.vllm.kv.metadata import HSRun, KVStepMetadata
from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide
from lmcache_async.integration.vllm.kv.store import KVStore
from lmcache_async.integration.vllm.kv.worker import KVWorkerSide

from .test_kv_connector_sides import BPC, BS, CHUNK, META, PROMPT, build, caches, config, vreq

AUX = [1, 4]
HIDDEN = 5
HS_BS = 2  # the hidden-state group's own block size (smaller than the attention group's)
KV_SRC, HS_SRC = [9, 3, 12, 0, 5, 7, 1, 2], list(range(20, 35))
KV_DST, HS_DST = [4, 6, 8, 10, 11, 13, 14, 15], list(range(40, 55))


def hs_cache(seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(64, len(AUX), HS_BS, HIDDEN)
    return torch.randn(64, len(AUX), HS_BS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def step(req_id: str, kv_blocks: list[int], hs_blocks: list[int], computed: int, scheduled: int) -> SimpleNamespace:
    new = SimpleNamespace(
        req_id=req_id, prompt_token_ids=PROMPT, block_ids=(kv_blocks, hs_blocks), num_computed_tokens=computed
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: scheduled},
        total_num_scheduled_tokens=scheduled,
    )


def sides(store: KVStore, group: HiddenStateGroup) -> tuple[KVSchedulerSide, KVWorkerSide]:
    sm = store.storage_manager
    sched = KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, kv_group=0, hs_group=1)
    worker = KVWorkerSide(sm, store.token_database, BS, BPC, hidden_state_store=store.hidden_state_store)
    return sched, worker


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[KVStore, KVStore]]:
    first = KVStore(config(tmp_path / "disk"), META)
    second = KVStore(config(tmp_path / "disk"), META)
    yield first, second
    first.close()
    second.close()


def test_rows_go_to_the_slots_of_the_groups_own_blocks() -> None:
    group = HiddenStateGroup(hs_cache(None), AUX)
    rows = torch.arange(5 * len(AUX) * HIDDEN, dtype=torch.float32).view(5, len(AUX), HIDDEN)
    group.scatter([7, 3, 9], 1, rows)  # tokens 1..5: block 7 slot 1, block 3 slots 0-1, block 9 ...
    assert torch.equal(group.cache[7, :, 1], rows[0])
    assert torch.equal(group.cache[3, :, 0], rows[1]) and torch.equal(group.cache[9, :, 1], rows[4])
    assert torch.equal(group.gather([7, 3, 9], 1, 6), rows)
    with pytest.raises(ValueError, match="blocks"):
        group.gather([7, 3], 0, 5)
    with pytest.raises(ValueError, match="aux"):
        HiddenStateGroup(hs_cache(None), [0])


def test_hidden_states_are_saved_with_the_kv_and_restored_by_a_new_store(
    stores: tuple[KVStore, KVStore], tmp_path: Path
) -> None:
    src_kv, src_hs = caches(seed=1), HiddenStateGroup(hs_cache(seed=2), AUX)
    sched, worker = sides(stores[0], src_hs)
    worker.register(src_kv, src_hs)
    meta = build(sched, step("r1", KV_SRC, HS_SRC, 0, len(PROMPT)))
    assert len(meta.hs_saves) == 1 and (meta.hs_saves[0].start, meta.hs_saves[0].end) == (0, 3 * CHUNK)
    round_trip = KVStepMetadata.from_dict(meta.to_dict())
    assert round_trip == meta
    worker.save(meta)
    assert worker.counters["hs_saved_runs"] == 1 and worker.counters["errors"] == 0
    stores[0].storage_manager.flush_sync()

    dst_kv, dst_hs = caches(seed=None), HiddenStateGroup(hs_cache(None), AUX)
    sched2, worker2 = sides(stores[1], dst_hs)
    worker2.register(dst_kv, dst_hs)
    n, is_async = sched2.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    assert (n, is_async) == (3 * CHUNK, True)
    sched2.after_alloc(vreq("r2"), (KV_DST, HS_DST), n)
    load_meta = build(sched2, step("r2", KV_DST, HS_DST, 0, len(PROMPT) - n))
    assert [(r.start, r.end, r.block_ids) for r in load_meta.hs_loads] == [(0, n, tuple(HS_DST))]
    worker2.load(load_meta)
    assert worker2.finished_loads(wait_s=30.0) == {"r2"}
    assert worker2.take_load_errors() == set()
    assert worker2.counters["hs_loaded_tokens"] == n
    assert torch.equal(dst_hs.gather(HS_DST, 0, n), src_hs.gather(HS_SRC, 0, n))
    assert not dst_hs.gather(HS_DST, n, len(PROMPT)).any()  # the rest is vLLM's to compute
    for name in src_kv:
        for s, d in zip(KV_SRC[:6], KV_DST[:6], strict=True):
            assert torch.equal(dst_kv[name][d], src_kv[name][s])


def test_kv_beyond_a_missing_hidden_state_chunk_is_recomputed(stores: tuple[KVStore, KVStore], tmp_path: Path) -> None:
    src_hs = HiddenStateGroup(hs_cache(seed=2), AUX)
    sched, worker = sides(stores[0], src_hs)
    worker.register(caches(seed=1), src_hs)
    worker.save(build(sched, step("r1", KV_SRC, HS_SRC, 0, len(PROMPT))))
    stores[0].storage_manager.flush_sync()
    key = stores[0].token_database.keys(PROMPT)[1]
    os.unlink(entry_path(str(tmp_path / "disk"), key_digest(hs_entry_key(key, AUX[1]).to_string())))

    dst_hs = HiddenStateGroup(hs_cache(None), AUX)
    sched2, worker2 = sides(stores[1], dst_hs)
    worker2.register(caches(seed=None), dst_hs)
    n, _ = sched2.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    sched2.after_alloc(vreq("r2"), (KV_DST, HS_DST), n)
    worker2.load(build(sched2, step("r2", KV_DST, HS_DST, 0, len(PROMPT) - n)))
    assert worker2.finished_loads(wait_s=30.0) == {"r2"}
    # chunk 0 keeps its KV and hidden states; chunks 1 and 2 (blocks 2..5) are recomputed
    assert worker2.take_load_errors() == set(KV_DST[2:6])
    assert worker2.counters["hs_short_loads"] == 1 and worker2.counters["hs_loaded_tokens"] == CHUNK
    assert torch.equal(dst_hs.gather(HS_DST, 0, CHUNK), src_hs.gather(HS_SRC, 0, CHUNK))
    assert worker2.recent_hs_runs[-1][0] == "load" and worker2.recent_hs_runs[-1][1].end == CHUNK


def test_a_group_needs_a_hidden_state_store(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "disk", enable_hidden_state_cache=False), META)
    try:
        worker = KVWorkerSide(store.storage_manager, store.token_database, BS, BPC)
        with pytest.raises(ValueError, match="enable_hidden_state_cache"):
            worker.register(caches(seed=1), HiddenStateGroup(hs_cache(None), AUX))
    finally:
        store.close()


def test_a_run_refuses_a_bad_token_range_and_bad_fields() -> None:
    with pytest.raises(ValueError, match="tokens"):
        HSRun("r", (1, 2, 3), 5, 2, (0,))
    with pytest.raises(TypeError, match="chunk_hashes"):
        HSRun.from_dict({"req_id": "r", "chunk_hashes": [1, "2"], "start": 0, "end": 1, "block_ids": [0]})
    with pytest.raises(ValueError, match="lacks"):
        HSRun.from_dict({"req_id": "r", "token_ids": [1], "start": 0, "end": 1, "block_ids": [0]})
