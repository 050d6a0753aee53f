"""Reads into caller memory through the node server's tier: a direct reader of the shared pool.

``read_into_sync`` asks the server once per batch (no staging buffer, no loop hop) and, with
``prefix``, follows the keys across tiers (the CPU tier, the server, the disk); the server's
hits count as memory the caller reads on its own thread (``memory_prefix_len``)."""

from __future__ import annotations

from pathlib import Path

import torch
from support.server_config import server_tier_config

from lmcache_async import LMCacheEngineConfig, StorageManager
from lmcache_async.read_sinks import ReadSink
from lmcache_async.server.tier import ServerTier
from lmcache_async.testing.conformance import make_key

SHAPE = (64, 128)


_config = server_tier_config


def _value(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def _sink(dst: torch.Tensor) -> ReadSink:
    base, n = dst.data_ptr(), dst.numel() * 4
    return ReadSink(SHAPE, torch.float32, ((base, n // 2), (base + n // 2, n - n // 2)))


def test_the_server_tier_reads_into_caller_memory_and_answers_on_the_callers_thread(shared_server) -> None:
    sm = StorageManager(_config(shared_server.socket, "into-proto"), name="proto")
    try:
        tier = sm.backend("server")
        assert isinstance(tier, ServerTier)
        assert tier.as_direct_reader() is tier
        assert tier.as_local() is tier
    finally:
        sm.close_sync()


def test_a_prefix_read_follows_the_keys_across_cpu_server_and_disk(shared_server, tmp_path: Path) -> None:
    ns, disk = "into-stack", str(tmp_path / "disk")
    keys = [make_key(700 + i) for i in range(5)]
    server_only = StorageManager(_config(shared_server.socket, ns), name="server-writer")
    disk_only = StorageManager(
        LMCacheEngineConfig.from_defaults(
            local_cpu=False, tier_order=["disk"], local_disk=disk, max_local_disk_size=0.1
        ),
        name="disk-writer",
    )
    reader = StorageManager(
        _config(
            shared_server.socket, ns, local_cpu=True, max_local_cpu_size=1 / 32,
            tier_order=["cpu", "server", "disk"], local_disk=disk, max_local_disk_size=0.1,
        ),
        name="reader",
    )  # fmt: skip
    try:
        for i in (0, 1, 3):  # in the node's shared pool
            assert server_only.put_sync(keys[i], _value(i))
        assert disk_only.put_sync(keys[2], _value(2))  # on the disk only
        disk_only.flush_sync()
        assert reader.put_sync(keys[4], _value(4))  # in the reader's CPU tier (and written through)
        reader.flush_sync()
        assert reader.memory_prefix_len(keys) == 2  # key 2 is on the disk: not memory
        dsts = [torch.zeros(SHAPE) for _ in keys]
        assert reader.read_into_sync(keys, [_sink(d) for d in dsts], prefix=True) == [True] * 5
        for i, d in enumerate(dsts):
            assert torch.equal(d, _value(i)), i
        tiers = reader.stats()["tiers"]
        # 0-1 from the server, 2 from the disk, then the server reads on as far as it can: 3 and
        # 4 (written through from the reader's CPU tier)
        assert tiers["server"]["direct_hits"] == 4 and tiers["disk"]["direct_hits"] == 1
        assert reader.stats()["read_into"] == {"hits": 5, "misses": 0, "mismatches": 0, "timeouts": 0}
        assert reader.memory_prefix_len([keys[4], keys[0], keys[1]]) == 3  # CPU tier, then the server
    finally:
        for sm in (server_only, disk_only, reader):
            sm.close_sync()


def test_a_read_from_a_server_that_went_away_is_a_miss_within_the_timeout(make_server) -> None:
    srv = make_server().start()
    writer = StorageManager(_config(srv.socket, "into-gone", remote_timeout_s=1.0), name="writer")
    reader = StorageManager(_config(srv.socket, "into-gone", remote_timeout_s=1.0), name="reader")
    try:
        assert writer.put_sync(make_key(1), _value(1))
        assert reader.memory_prefix_len([make_key(1)]) == 1
        srv.kill()
        dst = torch.zeros(SHAPE)
        assert reader.read_into_sync([make_key(1)], [_sink(dst)], prefix=True) == [False]
        assert reader.memory_prefix_len([make_key(1)]) == 0
        assert reader.stats()["read_into"]["misses"] == 1
    finally:
        writer.close_sync()
        reader.close_sync()


def test_the_kv_connector_loads_a_hit_in_the_nodes_pool_synchronously_in_a_new_store(shared_server) -> None:
    """A prefix another process stored in the node server is loaded in ``start_load_kv`` (no
    asynchronous load, no lower-tier hop): straight from the shared pool into vLLM's blocks."""
    from types import SimpleNamespace

    from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide
    from lmcache_async.integration.vllm.kv.store import KVStore
    from lmcache_async.integration.vllm.kv.worker import KVWorkerSide
    from lmcache_async.metadata import LMCacheEngineMetadata

    BS, BPC = 4, 2  # block size, blocks per chunk
    CHUNK = BS * BPC
    PROMPT = list(range(100, 130))  # 30 tokens: 3 whole chunks
    META = LMCacheEngineMetadata("tiny-into", kv_dtype=torch.float32)
    SRC_BLOCKS, DST_BLOCKS = [9, 3, 12, 0, 5, 7, 1, 2], [4, 6, 8, 10, 11, 13, 14, 15]

    def caches(seed: int | None) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed or 0)
        make = torch.zeros if seed is None else lambda *shape: torch.randn(*shape, generator=g)
        return {f"l{i}": make(16, 2, BS, 6) for i in range(2)}

    def new_req_step(req_id: str, block_ids: list[int], computed: int, scheduled: int) -> SimpleNamespace:
        new = SimpleNamespace(
            req_id=req_id, prompt_token_ids=PROMPT, block_ids=(block_ids,), num_computed_tokens=computed
        )
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
        return SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: scheduled}
        )

    def vreq(req_id: str) -> SimpleNamespace:
        return SimpleNamespace(request_id=req_id, prompt_token_ids=PROMPT, num_prompt_tokens=len(PROMPT))

    def store(cpu: bool) -> KVStore:
        conf = _config(shared_server.socket, "into-kv", chunk_size=CHUNK, local_cpu=cpu, max_local_cpu_size=0.01)
        if cpu:
            conf.set("tier_order", ["cpu", "server"], "test")
        return KVStore(conf, META)

    def sides(s: KVStore) -> tuple[KVSchedulerSide, KVWorkerSide]:
        sm = s.storage_manager
        return KVSchedulerSide(lambda: sm, s.token_database, BS, BPC), KVWorkerSide(sm, s.token_database, BS, BPC)

    first, second = store(cpu=False), store(cpu=True)
    try:
        sched, worker = sides(first)
        src = caches(seed=1)
        worker.register(src)
        sched.after_alloc(vreq("r1"), None, 0)  # vLLM shows the Request before it schedules it
        worker.save(sched.build_meta(new_req_step("r1", SRC_BLOCKS, 0, len(PROMPT))))
        assert worker.counters["saved_chunks"] == 3
        sched, worker = sides(second)
        dst = caches(seed=None)
        worker.register(dst)
        n, is_async = sched.num_new_matched_tokens(vreq("r2"), 0)
        assert n == 24 and not is_async  # in the node's pool: memory the worker reads itself
        sched.after_alloc(vreq("r2"), (DST_BLOCKS,), n)
        meta = sched.build_meta(new_req_step("r2", DST_BLOCKS, 0, len(PROMPT) - n))
        assert len(meta.loads) == 1 and not meta.async_loads
        worker.load(meta)
        assert worker.take_load_errors() == set() and worker.counters["loaded_blocks"] == 6
        for name in src:
            for s, d in zip(SRC_BLOCKS[:6], DST_BLOCKS[:6], strict=True):
                assert torch.equal(dst[name][d], src[name][s])
        assert second.storage_manager.stats()["tiers"]["server"]["direct_hits"] == 3
    finally:
        first.close()
        second.close()
