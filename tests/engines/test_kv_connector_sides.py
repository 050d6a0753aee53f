"""The KV connector's scheduler and worker halves over a real StorageManager (CPU + disk tiers).

vLLM is not needed: the scheduler output is given as the plain attributes vLLM's objects carry
(``scheduled_new_reqs``, ``scheduled_cached_reqs``, ``num_scheduled_tokens``), and a second store
on the same disk directory plays the part of a new engine process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.integration.vllm.kv.hidden import publish_hidden_states, restore_hidden_states
from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide
from lmcache_async.integration.vllm.kv.store import (
    KVStore,
    acquire_store,
    find_worker_store,
    kv_dtype_of,
    load_kv_connector_config,
    release_store,
)
from lmcache_async.integration.vllm.kv.worker import KVWorkerSide
from lmcache_async.metadata import LMCacheEngineMetadata

BS, BPC = 4, 2  # block size, blocks per chunk
CHUNK = BS * BPC
NB, HEADS, HEAD, LAYERS = 16, 2, 3, 2
PROMPT = list(range(100, 130))  # 30 tokens: 3 whole chunks, 8 blocks
META = LMCacheEngineMetadata("tiny", kv_dtype=torch.float32)


def config(disk: Path, **extra: Any) -> LMCacheEngineConfig:
    values: dict[str, Any] = dict(
        chunk_size=CHUNK,
        max_local_cpu_size=0.01,
        staging_size=0.01,
        local_disk=str(disk),
        max_local_disk_size=0.1,
        enable_hidden_state_cache=True,
        max_hidden_state_cpu_size=0.01,
    )
    values.update(extra)
    return LMCacheEngineConfig(**values)


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    if seed is None:
        return {f"l{i}": torch.zeros(NB, HEADS, BS, 2 * HEAD) for i in range(LAYERS)}
    return {f"l{i}": torch.randn(NB, HEADS, BS, 2 * HEAD, generator=g) for i in range(LAYERS)}


def new_req_step(req_id: str, block_ids: list[int], computed: int, scheduled: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=PROMPT, block_ids=(block_ids,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: scheduled}
    )


def vreq(req_id: str, prompt: list[int] | None = None, **extras: Any) -> SimpleNamespace:
    """The attributes of a scheduler-side vLLM ``Request`` the connector reads (no extras
    unless given: ``mm_features``, ``lora_request``, ``cache_salt``, ``prompt_embeds``)."""
    tokens = list(PROMPT if prompt is None else prompt)
    fields: dict[str, Any] = dict(mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None)
    fields.update(extras)
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens), **fields)


def build(sched: KVSchedulerSide, step: Any) -> Any:
    """``sched.build_meta(step)`` after vLLM's ``update_state_after_alloc`` for each new request
    of the step that the scheduler has not seen yet (vLLM calls it before every schedule)."""
    for new in getattr(step, "scheduled_new_reqs", ()) or ():
        if new.req_id not in sched._reqs:
            sched.after_alloc(vreq(new.req_id, list(new.prompt_token_ids)), None, 0)
    return sched.build_meta(step)


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[KVStore, KVStore]]:
    first = KVStore(config(tmp_path / "disk"), META)
    second = KVStore(config(tmp_path / "disk"), META)
    yield first, second
    first.close()
    second.close()


def sides(store: KVStore) -> tuple[KVSchedulerSide, KVWorkerSide]:
    sm = store.storage_manager
    return (KVSchedulerSide(lambda: sm, store.token_database, BS, BPC), KVWorkerSide(sm, store.token_database, BS, BPC))


SRC_BLOCKS = [9, 3, 12, 0, 5, 7, 1, 2]
DST_BLOCKS = [4, 6, 8, 10, 11, 13, 14, 15]


def store_prompt(store: KVStore) -> dict[str, torch.Tensor]:
    sched, worker = sides(store)
    src = caches(seed=1)
    worker.register(src)
    meta = build(sched, new_req_step("r1", SRC_BLOCKS, 0, len(PROMPT)))
    assert not meta.loads and len(meta.saves) == 1
    worker.save(meta)
    assert worker.counters["saved_chunks"] == 3
    store.storage_manager.flush_sync()
    return src


def load_prompt(store: KVStore) -> tuple[KVSchedulerSide, KVWorkerSide, dict[str, torch.Tensor], int]:
    sched, worker = sides(store)
    dst = caches(seed=None)
    worker.register(dst)
    n, is_async = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    assert is_async  # only the disk tier holds it in this store
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    meta = build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n))
    assert not meta.loads and len(meta.async_loads) == 1
    worker.load(meta)
    wait_loads(worker, {"r2"})
    return sched, worker, dst, n


def wait_loads(worker: KVWorkerSide, req_ids: set[str]) -> None:
    """Collect the asynchronous loads of ``req_ids`` (each bounded by the manager's timeouts)."""
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while done != req_ids and time.monotonic() < deadline:
        done |= worker.finished_loads()
        time.sleep(0.005)
    assert done == req_ids


def test_a_stored_prompt_is_restored_block_for_block_by_another_store(stores: tuple[KVStore, KVStore]) -> None:
    src = store_prompt(stores[0])
    sched, worker, dst, n = load_prompt(stores[1])
    assert n == 24  # 3 whole chunks; the last token (29) must be computed by vLLM
    assert worker.take_load_errors() == set()
    assert worker.counters["loaded_blocks"] == 6
    for name in src:
        for s, d in zip(SRC_BLOCKS[:6], DST_BLOCKS[:6], strict=True):
            assert torch.equal(dst[name][d], src[name][s])
        assert not dst[name][DST_BLOCKS[6:]].any()


def test_an_asynchronous_load_reads_straight_into_the_blocks_on_the_load_thread(
    stores: tuple[KVStore, KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host caches: the load thread reads the records from the disk tier straight into vLLM's
    blocks (``read_into_sync``: file reads and ``memmove`` only; no scatter, no torch copy), and
    the request is reported by ``finished_loads`` once that read returned."""
    import threading

    from lmcache_async.integration.vllm.kv import worker as kv_worker

    src = store_prompt(stores[0])
    sched, worker = sides(stores[1])
    dst = caches(seed=None)
    worker.register(dst)
    scatters: list[str] = []
    monkeypatch.setattr(kv_worker, "scatter_blocks", lambda *a, **k: scatters.append("called"))
    read_threads: list[str] = []
    sm = worker.manager
    real_read = sm.read_into_sync

    def recording_read(*args: Any, **kwargs: Any) -> list[bool]:
        read_threads.append(threading.current_thread().name)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(sm, "read_into_sync", recording_read)
    n, is_async = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert is_async and n == 24
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    worker.load(build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n)))
    _, fut, _ = worker._inflight["r2"]
    fut.result(timeout=30)
    assert len(read_threads) == 1 and read_threads[0].startswith("lmcache-async-kv-load")
    for name in src:  # in place before the request is reported
        for s, d in zip(SRC_BLOCKS[:6], DST_BLOCKS[:6], strict=True):
            assert torch.equal(dst[name][d], src[name][s])
    assert worker.finished_loads() == {"r2"}
    assert scatters == [] and worker.take_load_errors() == set()
    stats = sm.stats()
    assert stats["read_into"]["hits"] == 3 and stats["tiers"]["disk"]["direct_hits"] == 3


def test_an_idle_step_waits_for_a_load_in_flight(stores: tuple[KVStore, KVStore]) -> None:
    """A step with no tokens scheduled is marked idle; its ``finished_loads(wait_s)`` blocks
    for the load instead of returning at once (vLLM would spin through empty steps)."""
    store_prompt(stores[0])
    sched, worker = sides(stores[1])
    worker.register(caches(seed=None))
    n, _ = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    meta = build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n))
    assert not meta.idle
    worker.load(meta)
    empty = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )
    assert build(sched, empty).idle
    assert worker.finished_loads(wait_s=30.0) == {"r2"}  # one call: it waited for the read
    assert worker.take_load_errors() == set()
    assert worker.finished_loads(wait_s=30.0) == set()  # nothing in flight: no wait


def test_closing_with_an_unapplied_load_releases_its_records(stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(stores[0])
    sched, worker = sides(stores[1])
    worker.register(caches(seed=None))
    n, _ = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    worker.load(build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n)))
    _, fut, _ = worker._inflight["r2"]
    fetched = fut.result(timeout=30)
    assert fetched is not None and all(o is not None for o in fetched.objs)
    objs = list(fetched.objs)
    before = [o.get_ref_count() for o in objs if o is not None]
    worker.close()
    assert fetched.objs == []
    assert [o.get_ref_count() for o in objs if o is not None] == [r - 1 for r in before]


def test_the_hit_stops_below_the_last_prompt_token_on_a_block_boundary(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    try:
        sched, worker = sides(store)
        worker.register(caches(seed=1))
        prompt = PROMPT[:24]  # exactly 3 chunks: the last block must be recomputed
        step = new_req_step("a", SRC_BLOCKS[:6], 0, 24)
        step.scheduled_new_reqs[0].prompt_token_ids = prompt
        worker.save(build(sched, step))
        assert sched.num_new_matched_tokens(vreq("b", prompt), 0) == (20, False)  # the CPU tier holds it
        assert sched.num_new_matched_tokens(vreq("c", prompt), 20) == (0, False)  # vLLM already holds it all
    finally:
        store.close()


def test_a_miss_plans_no_load(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    try:
        sched, _ = sides(store)
        assert sched.num_new_matched_tokens(vreq("r", PROMPT), 0) == (0, False)
        sched.after_alloc(vreq("r"), ([1, 2],), 0)
        assert build(sched, new_req_step("r", DST_BLOCKS, 0, 30)).loads == []
    finally:
        store.close()


def test_locally_computed_blocks_are_not_overwritten(stores: tuple[KVStore, KVStore]) -> None:
    src = store_prompt(stores[0])
    sched, worker = sides(stores[1])
    dst = caches(seed=None)
    worker.register(dst)
    n, _ = sched.num_new_matched_tokens(vreq("r2", PROMPT), 8)  # vLLM's prefix cache holds chunk 0
    assert n == 16
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    meta = build(sched, new_req_step("r2", DST_BLOCKS, 8, len(PROMPT) - 24))
    assert [(r.first_block, r.block_ids) for r in meta.async_loads] == [(2, tuple(DST_BLOCKS[2:6]))]
    worker.load(meta)
    wait_loads(worker, {"r2"})
    for name in src:
        assert not dst[name][DST_BLOCKS[:2]].any()
        assert torch.equal(dst[name][DST_BLOCKS[5]], src[name][SRC_BLOCKS[5]])


def test_a_load_from_the_middle_of_a_chunk_fills_only_the_blocks_it_names(stores: tuple[KVStore, KVStore]) -> None:
    """vLLM's prefix cache holds block 0: the load reads chunk 0's record straight into block 1
    (block 0 of the record goes to scratch) and chunks 1-2 whole; block 0 stays untouched."""
    src = store_prompt(stores[0])
    sched, worker = sides(stores[1])
    dst = caches(seed=None)
    worker.register(dst)
    n, _ = sched.num_new_matched_tokens(vreq("r2", PROMPT), BS)
    assert n == 24 - BS
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    meta = build(sched, new_req_step("r2", DST_BLOCKS, BS, len(PROMPT) - 24))
    assert [(r.first_block, r.block_ids) for r in meta.async_loads] == [(1, tuple(DST_BLOCKS[1:6]))]
    worker.load(meta)
    wait_loads(worker, {"r2"})
    assert worker.take_load_errors() == set() and worker.counters["loaded_blocks"] == 5
    for name in src:
        assert not dst[name][DST_BLOCKS[0]].any()
        for s, d in zip(SRC_BLOCKS[1:6], DST_BLOCKS[1:6], strict=True):
            assert torch.equal(dst[name][d], src[name][s])


def test_a_record_deleted_after_the_lookup_fails_only_its_blocks_and_later_ones(
    stores: tuple[KVStore, KVStore],
) -> None:
    store_prompt(stores[0])
    sched, worker = sides(stores[1])
    worker.register(caches(seed=None))
    n, _ = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    meta = build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n))
    key = stores[1].token_database.keys(PROMPT)[1]
    stores[0].storage_manager.remove_sync(key)  # behind the second store's back
    stores[1].storage_manager.remove_sync(key)
    worker.load(meta)
    wait_loads(worker, {"r2"})
    assert worker.take_load_errors() == set(DST_BLOCKS[2:6])
    assert worker.take_load_errors() == set()  # reported once
    assert worker.counters["loaded_chunks"] == 1


def test_a_record_of_another_shape_is_a_load_failure_not_an_exception(stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(stores[0])
    sched, worker = sides(stores[1])
    # this worker's caches have more heads: the stored records do not fit
    worker.register({f"l{i}": torch.zeros(NB, HEADS + 1, BS, 2 * HEAD) for i in range(LAYERS)})
    n, _ = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
    assert n is not None  # the lookup ran on this thread
    sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
    worker.load(build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n)))
    wait_loads(worker, {"r2"})
    assert worker.take_load_errors() == set(DST_BLOCKS[:6])


def test_a_failing_lookup_is_a_miss_and_counted(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    sched, _ = sides(store)
    store.close()
    assert sched.num_new_matched_tokens(vreq("r", PROMPT), 0) == (0, False)
    assert sched.counters["lookup_errors"] == 1


def test_saves_follow_chunked_prefill_and_decode_blocks(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    try:
        sched, worker = sides(store)
        worker.register(caches(seed=3))
        meta = build(sched, new_req_step("r", SRC_BLOCKS[:3], 0, 12))  # 12 tokens this step
        assert [(r.first_block, r.block_ids) for r in meta.saves] == [(0, tuple(SRC_BLOCKS[:2]))]
        worker.save(meta)
        cached = SimpleNamespace(
            req_ids=["r"], new_block_ids=[(SRC_BLOCKS[3:],)], num_computed_tokens=[12], resumed_req_ids=set()
        )
        step = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 18})
        meta = build(sched, step)
        assert [(r.first_block, r.block_ids) for r in meta.saves] == [(2, tuple(SRC_BLOCKS[2:6]))]
        worker.save(meta)
        assert worker.counters["saved_chunks"] == 3
        assert store.storage_manager.prefix_len_sync(store.token_database.keys(PROMPT)) == 3
        sched.finished("r")
    finally:
        store.close()


def test_a_full_pool_stops_the_save_and_counts_it(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d", max_local_cpu_size=0.0, local_disk=None), META)
    try:
        sched, worker = sides(store)
        worker.register(caches(seed=1))
        worker.save(build(sched, new_req_step("r", SRC_BLOCKS, 0, 30)))
        assert worker.counters["saved_chunks"] == 0
        assert worker.counters["save_rejected"] == 1
    finally:
        store.close()


def test_hidden_states_published_by_one_store_come_back_bit_exact_from_another(
    stores: tuple[KVStore, KVStore],
) -> None:
    store_prompt(stores[0])
    hs = torch.randn(len(PROMPT), 5)
    a, b = stores
    assert a.hidden_state_store is not None and b.hidden_state_store is not None
    assert publish_hidden_states(a.hidden_state_store, a.storage_manager, PROMPT, hs, layer_idx=2) == 3
    a.storage_manager.flush_sync()
    got = restore_hidden_states(b.hidden_state_store, b.storage_manager, PROMPT, layer_idx=2)
    assert got is not None and torch.equal(got, hs[:24])
    got[0, 0] = 1.0  # the caller owns a normal tensor
    capped = restore_hidden_states(b.hidden_state_store, b.storage_manager, PROMPT, layer_idx=2, max_tokens=20)
    assert capped is not None and torch.equal(capped, hs[:16])  # never past the restored KV prefix
    assert restore_hidden_states(b.hidden_state_store, b.storage_manager, PROMPT, layer_idx=1) is None


def test_hidden_states_stop_where_the_kv_is_gone(stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(stores[0])
    a, b = stores
    assert a.hidden_state_store is not None and b.hidden_state_store is not None
    hs = torch.randn(len(PROMPT), 5)
    publish_hidden_states(a.hidden_state_store, a.storage_manager, PROMPT, hs)
    a.storage_manager.flush_sync()
    key = b.token_database.keys(PROMPT)[1]
    a.storage_manager.remove_sync(key)
    b.storage_manager.remove_sync(key)
    got = restore_hidden_states(b.hidden_state_store, b.storage_manager, PROMPT)
    assert got is not None and torch.equal(got, hs[:CHUNK])


def test_max_tokens_must_not_be_negative(stores: tuple[KVStore, KVStore]) -> None:
    a = stores[0]
    assert a.hidden_state_store is not None
    with pytest.raises(ValueError, match="max_tokens"):
        restore_hidden_states(a.hidden_state_store, a.storage_manager, PROMPT, max_tokens=-1)


def test_a_scheduler_shares_the_workers_store_or_builds_a_lookup_only_one(tmp_path: Path) -> None:
    cfg = config(tmp_path / "d")
    lease_s, sched_store = acquire_store(cfg, META, role="scheduler")
    try:
        assert sched_store.lookup_only and sched_store.storage_manager.pool is None
        assert sched_store.hidden_state_store is None
        assert find_worker_store(cfg, META) is None
        lease_w, worker_store = acquire_store(cfg, META, role="worker")
        lease_s2, shared = acquire_store(cfg, META, role="scheduler")
        assert shared is worker_store and not worker_store.lookup_only
        assert find_worker_store(cfg, META) is worker_store
        release_store(lease_s2)
        release_store(lease_w)
        assert worker_store.closed
    finally:
        release_store(lease_s)
    assert sched_store.closed
    with pytest.raises(ValueError, match="role"):
        acquire_store(cfg, META, role="both")


def test_inline_connector_config_overrides_and_unknown_keys_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("chunk_size: 512\nmax_local_cpu_size: 0.5\n")
    cfg = load_kv_connector_config({"config_file": str(yaml), "max_local_cpu_size": 0.25, "bogus": 1})
    assert cfg.chunk_size == 512 and cfg.max_local_cpu_size == 0.25
    with pytest.raises(TypeError, match="config_file"):
        load_kv_connector_config({"config_file": 5})


def test_key_dtype_follows_vllms_cache_dtype() -> None:
    assert kv_dtype_of("auto", torch.float32) is torch.float32
    assert kv_dtype_of("auto", "bfloat16") is torch.bfloat16
    assert kv_dtype_of("fp8_e5m2", torch.float16) is torch.float8_e5m2


def test_a_hit_in_this_process_cpu_tier_is_loaded_before_the_forward(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    try:
        src = store_prompt(store)
        sched, worker = sides(store)
        dst = caches(seed=None)
        worker.register(dst)
        n, is_async = sched.num_new_matched_tokens(vreq("r2", PROMPT), 0)
        assert n is not None  # the lookup ran on this thread
        assert (n, is_async) == (24, False)
        sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
        meta = build(sched, new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n))
        assert len(meta.loads) == 1 and not meta.async_loads
        worker.load(meta)
        assert worker.finished_loads() == set()  # nothing asynchronous to report
        for name in src:
            assert torch.equal(dst[name][DST_BLOCKS[5]], src[name][SRC_BLOCKS[5]])
    finally:
        store.close()


def test_a_store_without_a_cpu_tier_saves_through_host_tensors(tmp_path: Path) -> None:
    """``tier_order`` without ``cpu`` (the node server alone, here the disk tier): no pool to
    gather into, so the worker gathers into host tensors the put copies; a new store loads them."""
    lone = KVStore(config(tmp_path / "disk", tier_order=["disk"]), META)
    try:
        assert "cpu" not in lone.storage_manager.tier_names
        src = store_prompt(lone)
    finally:
        lone.close()
    fresh = KVStore(config(tmp_path / "disk"), META)
    try:
        _, worker, dst, n = load_prompt(fresh)
        assert n == 24 and worker.take_load_errors() == set()
        for name in src:
            for s, d in zip(SRC_BLOCKS[:6], DST_BLOCKS[:6], strict=True):
                assert torch.equal(dst[name][d], src[name][s])
    finally:
        fresh.close()


def test_keys_carry_the_requests_extras_and_saves_never_fall_back_to_plain_keys(
    stores: tuple[KVStore, KVStore],
) -> None:
    """A prompt saved under ``cache_salt="alice"`` is found under that salt only; a request the
    scheduler output shows without vLLM having shown its Request is not saved (its extras
    are unknown); a request whose multimodal feature has no identifier is neither loaded nor
    saved, counted."""
    first, second = stores
    sched, worker = sides(first)
    worker.register(caches(seed=1))
    sched.after_alloc(vreq("a", cache_salt="alice"), None, 0)
    worker.save(sched.build_meta(new_req_step("a", SRC_BLOCKS, 0, len(PROMPT))))
    assert worker.counters["saved_chunks"] == 3
    first.storage_manager.flush_sync()

    sched2, _ = sides(second)
    assert sched2.num_new_matched_tokens(vreq("b1", cache_salt="bob"), 0) == (0, False)
    assert sched2.num_new_matched_tokens(vreq("b2"), 0) == (0, False)  # no salt: another tenant too
    n, _ = sched2.num_new_matched_tokens(vreq("b3", cache_salt="alice"), 0)
    assert n == 24

    sched3, worker3 = sides(second)
    worker3.register(caches(seed=2))
    assert not sched3.build_meta(new_req_step("unseen", SRC_BLOCKS, 0, len(PROMPT))).saves
    assert sched3.counters["unkeyed_saves_skipped"] == 1
    bad = vreq("bad", mm_features=[SimpleNamespace(identifier=None, mm_position=SimpleNamespace(offset=2, length=4))])
    assert sched3.num_new_matched_tokens(bad, 0) == (0, False)
    sched3.after_alloc(bad, None, 0)
    assert not sched3.build_meta(new_req_step("bad", SRC_BLOCKS, 0, len(PROMPT))).saves
    assert sched3.counters["unkeyed_requests"] == 1 and sched3.counters["lookups"] == 0
