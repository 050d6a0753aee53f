"""The KV engine: chunked store/retrieve/lookup over the StorageManager, LMCache's mask rules,
prefix semantics under pressure and over lower tiers."""

from __future__ import annotations

import pytest
import torch
from engines._data import CHUNK, UNSTORABLE_KINDS, kv_for, tokens, unstorable

from lmcache_async import LMCacheEngine, LMCacheEngineConfig, LoopThreadCallError, ManagerClosedError, MemoryFormat
from lmcache_async.token_database import ChunkedTokenDatabase


def test_round_trip_keeps_values_and_dtype(make_engine):
    eng = make_engine()
    toks = tokens(4 * CHUNK)
    kv = kv_for(4 * CHUNK, layers=3, dim=8, dtype=torch.bfloat16)
    assert eng.store(toks, kv) == 4
    n, got = eng.retrieve(toks)
    assert n == 4 * CHUNK
    assert got.dtype == torch.bfloat16 and got.shape == kv.shape and got.is_contiguous()
    assert torch.equal(got, kv)


def test_entries_use_the_token_database_keys_and_kv_format(make_engine, metadata):
    eng = make_engine()
    toks = tokens(3 * CHUNK)
    eng.store(toks, kv_for(3 * CHUNK))
    db = ChunkedTokenDatabase(CHUNK, metadata=metadata)
    keys = [k for _, _, k in db.process_tokens(toks)]
    assert keys == [k for _, _, k in eng.token_database.process_tokens(toks)]
    for k in keys:
        obj = eng.storage_manager.get_sync(k)
        assert obj is not None and obj.fmt == MemoryFormat.KV_2LTD and obj.shape == (2, 2, CHUNK, 8)
        obj.ref_count_down()


def test_storing_again_copies_nothing(make_engine):
    eng = make_engine()
    toks = tokens(3 * CHUNK)
    kv = kv_for(3 * CHUNK)
    assert eng.store(toks, kv) == 3
    used = eng.storage_manager.pool.used_bytes
    assert eng.store(toks, kv * 2) == 0
    assert eng.storage_manager.pool.used_bytes == used
    assert torch.equal(eng.retrieve(toks)[1], kv)


def test_lookup_is_the_cached_prefix_in_tokens(make_engine):
    eng = make_engine()
    toks = tokens(5 * CHUNK)
    assert eng.lookup(toks) == 0
    eng.store(toks[: 3 * CHUNK], kv_for(3 * CHUNK))
    assert eng.lookup(toks) == 3 * CHUNK
    assert eng.lookup(toks[: 2 * CHUNK + 3]) == 2 * CHUNK
    assert eng.lookup(tokens(5 * CHUNK, seed=1)) == 0
    assert eng.lookup([]) == 0


def test_retrieve_stops_at_the_first_missing_chunk(make_engine):
    eng = make_engine()
    toks = tokens(4 * CHUNK)
    kv = kv_for(4 * CHUNK)
    eng.store(toks, kv)
    eng.storage_manager.remove_sync(eng.token_database.keys(toks)[2])
    n, got = eng.retrieve(toks)
    assert n == 2 * CHUNK and torch.equal(got, kv[:, :, : 2 * CHUNK])
    assert eng.lookup(toks) == 2 * CHUNK


def test_retrieve_miss_is_zero_and_none(make_engine):
    eng = make_engine()
    assert eng.retrieve(tokens(2 * CHUNK)) == (0, None)
    assert eng.retrieve([]) == (0, None)


def test_store_of_an_empty_prompt_is_zero(make_engine):
    eng = make_engine()
    assert eng.store([], torch.empty(2, 1, 0, 4)) == 0


def test_partial_tail_follows_save_unfull_chunk(make_engine):
    n = 2 * CHUNK + 5
    eng = make_engine()
    assert eng.store(tokens(n), kv_for(n)) == 2
    assert eng.lookup(tokens(n)) == 2 * CHUNK
    eng2 = make_engine(save_unfull_chunk=True)
    kv = kv_for(n)
    assert eng2.store(tokens(n), kv) == 3
    got_n, got = eng2.retrieve(tokens(n))
    assert got_n == n and torch.equal(got, kv)


# ---- mask ----------------------------------------------------------------------------------------
def test_mask_skips_the_already_cached_prefix(make_engine):
    eng = make_engine()
    toks = tokens(4 * CHUNK)
    kv = kv_for(4 * CHUNK)
    eng.store(toks[: 2 * CHUNK], kv[:, :, : 2 * CHUNK])
    mask = torch.ones(4 * CHUNK, dtype=torch.bool)
    mask[: 2 * CHUNK] = False
    assert eng.store(toks, kv, mask=mask) == 2
    assert torch.equal(eng.retrieve(toks)[1], kv)


def test_kv_may_cover_only_the_unmasked_tokens(make_engine):
    eng = make_engine()
    toks = tokens(4 * CHUNK)
    kv = kv_for(4 * CHUNK)
    mask = [False] * CHUNK + [True] * (3 * CHUNK)
    assert eng.store(toks, kv[:, :, CHUNK:], mask=mask) == 3
    eng.store(toks[:CHUNK], kv[:, :, :CHUNK])
    assert torch.equal(eng.retrieve(toks)[1], kv)


def test_mask_prefix_must_be_a_multiple_of_the_chunk_size(make_engine):
    eng = make_engine()
    mask = [False] * 3 + [True] * (2 * CHUNK - 3)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        eng.store(tokens(2 * CHUNK), kv_for(2 * CHUNK), mask=mask)


def test_mask_must_be_false_then_true(make_engine):
    eng = make_engine()
    mask = [True] * CHUNK + [False] * CHUNK
    with pytest.raises(ValueError, match="mask"):
        eng.store(tokens(2 * CHUNK), kv_for(2 * CHUNK), mask=mask)
    with pytest.raises(ValueError, match="mask"):
        eng.store(tokens(2 * CHUNK), kv_for(2 * CHUNK), mask=[True] * 3)


# ---- caller mistakes ------------------------------------------------------------------------------
def test_kv_shape_and_type_are_checked(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match=r"\[2, num_layers, num_tokens, hidden\]"):
        eng.store(tokens(CHUNK), torch.zeros(2, CHUNK, 8))
    with pytest.raises(ValueError, match=r"\[2, num_layers, num_tokens, hidden\]"):
        eng.store(tokens(CHUNK), torch.zeros(3, 1, CHUNK, 8))
    with pytest.raises(TypeError, match="kv"):
        eng.store(tokens(CHUNK), [[0.0]])
    with pytest.raises(ValueError, match=f"expected len\\(token_ids\\) = {CHUNK}"):
        eng.store(tokens(CHUNK), kv_for(CHUNK - 1))
    with pytest.raises(TypeError, match="token_ids"):
        eng.lookup(torch.zeros(CHUNK))


@pytest.mark.parametrize("kind", UNSTORABLE_KINDS)
def test_store_of_a_tensor_without_dense_bytes_is_a_type_error_naming_kv(make_engine, kind):
    eng = make_engine()
    toks = tokens(2 * CHUNK, seed=7)
    with pytest.raises(TypeError, match=r"^kv "):
        eng.store(toks, unstorable(kind, (2, 2, 2 * CHUNK, 8)))
    assert eng.lookup(toks) == 0


_BAD_DEVICES = [
    "bogus",
    "meta",
    "cuda:4096",
    pytest.param("cuda:0", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
]


@pytest.mark.parametrize("device", _BAD_DEVICES)
def test_retrieve_to_a_device_this_machine_lacks_is_a_value_error_on_hit_and_miss(make_engine, device):
    eng = make_engine()
    toks = tokens(2 * CHUNK)
    with pytest.raises(ValueError, match="device"):
        eng.retrieve(toks, device=device)  # a miss
    eng.store(toks, kv_for(2 * CHUNK))
    with pytest.raises(ValueError, match="device"):
        eng.retrieve(toks, device=device)  # a hit
    with pytest.raises(TypeError, match="device"):
        eng.retrieve(toks, device=1.5)
    n, got = eng.retrieve(toks, device=torch.device("cpu"))
    assert n == 2 * CHUNK and got is not None


def test_constructor_checks_its_arguments(small_config):
    with pytest.raises(TypeError, match="config"):
        LMCacheEngine({"chunk_size": 16})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metadata"):
        LMCacheEngine(small_config(), "meta")  # type: ignore[arg-type]


# ---- pressure and tiers --------------------------------------------------------------------------
def _kv_chunk_bytes(layers=2, dim=8):
    return 2 * layers * CHUNK * dim * 4


def test_store_larger_than_the_pool_keeps_a_prefix(make_engine):
    eng = make_engine(max_local_cpu_size=6.5 * _kv_chunk_bytes() / (1 << 30))
    eng.store(tokens(3 * CHUNK, seed=1), kv_for(3 * CHUNK, seed=1))
    toks = tokens(10 * CHUNK)
    kv = kv_for(10 * CHUNK)
    assert eng.store(toks, kv) == 6
    n, got = eng.retrieve(toks)
    assert n == 6 * CHUNK and torch.equal(got, kv[:, :, : 6 * CHUNK])
    assert eng.lookup(tokens(3 * CHUNK, seed=1)) == 0


def test_pressure_evicts_a_prompts_suffix_before_its_prefix(make_engine):
    eng = make_engine(max_local_cpu_size=10.5 * _kv_chunk_bytes() / (1 << 30))
    a = tokens(6 * CHUNK, seed=1)
    eng.store(a, kv_for(6 * CHUNK, seed=1))
    eng.store(tokens(2 * CHUNK, seed=2), kv_for(2 * CHUNK, seed=2))
    eng.retrieve(a)  # a is used again
    eng.store(tokens(4 * CHUNK, seed=3), kv_for(4 * CHUNK, seed=3))  # needs 2 more chunks
    assert eng.lookup(a) == 6 * CHUNK  # the other prompt's chunks went first
    eng.store(tokens(4 * CHUNK, seed=4), kv_for(4 * CHUNK, seed=4))
    assert eng.lookup(a) >= 2 * CHUNK  # then a's suffix, never its prefix first


def test_retrieve_finds_chunks_in_a_lower_tier(make_engine, memory_tier):
    eng = make_engine(tier_order=["cpu", "test-memory"])
    toks = tokens(3 * CHUNK)
    kv = kv_for(3 * CHUNK)
    eng.store(toks, kv)
    eng.storage_manager.flush_sync()
    for k in eng.token_database.keys(toks):
        eng.storage_manager.backend("cpu").remove_nowait(k)
    assert eng.lookup(toks) == 3 * CHUNK
    n, got = eng.retrieve(toks)
    assert n == 3 * CHUNK and torch.equal(got, kv)
    assert eng.storage_manager.backend("cpu").contains_nowait(eng.token_database.keys(toks)[0])


def test_without_a_cpu_tier_chunks_go_through_staging(make_engine, memory_tier):
    eng = make_engine(local_cpu=False, tier_order=["cpu", "test-memory"])
    toks = tokens(3 * CHUNK)
    kv = kv_for(3 * CHUNK)
    assert eng.store(toks, kv) == 3
    eng.storage_manager.flush_sync()
    assert len(memory_tier[0].data) == 3
    n, got = eng.retrieve(toks)
    assert n == 3 * CHUNK and torch.equal(got, kv)


def test_disk_tier_serves_evicted_chunks(make_engine, tmp_path):
    pytest.importorskip("lmcache_async.disk.tier")
    eng = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    toks = tokens(3 * CHUNK)
    kv = kv_for(3 * CHUNK)
    eng.store(toks, kv)
    eng.storage_manager.flush_sync()
    for k in eng.token_database.keys(toks):
        eng.storage_manager.backend("cpu").remove_nowait(k)
    n, got = eng.retrieve(toks)
    assert n == 3 * CHUNK and torch.equal(got, kv)


def test_store_over_a_damaged_disk_chunk_stores_it_again(make_engine, tmp_path):
    pytest.importorskip("lmcache_async.disk.tier")
    toks = tokens(3 * CHUNK)
    kv = kv_for(3 * CHUNK)
    eng = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    assert eng.store(toks, kv) == 3
    eng.close()
    records = sorted(p for p in tmp_path.rglob("*.lmc") if not p.name.startswith("."))
    assert len(records) == 3
    for path in records:  # damage every chunk's record while no engine runs
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    eng = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    assert eng.store(toks, kv) == 3  # the disk's claims are not trusted: every chunk is stored
    n, got = eng.retrieve(toks)
    assert n == 3 * CHUNK and torch.equal(got, kv)
    eng.storage_manager.flush_sync()
    for k in eng.token_database.keys(toks):
        eng.storage_manager.backend("cpu").remove_nowait(k)
    n, got = eng.retrieve(toks)  # from the disk's replaced records
    assert n == 3 * CHUNK and torch.equal(got, kv)


# ---- lifecycle and async -------------------------------------------------------------------------
async def test_async_twins(make_engine):
    eng = make_engine()
    toks = tokens(2 * CHUNK)
    kv = kv_for(2 * CHUNK)
    assert await eng.astore(toks, kv) == 2
    assert await eng.alookup(toks) == 2 * CHUNK
    n, got = await eng.aretrieve(toks)
    assert n == 2 * CHUNK and torch.equal(got, kv)


async def test_async_context_manager_closes(small_config, metadata):
    async with LMCacheEngine(small_config(chunk_size=CHUNK), metadata) as eng:
        await eng.astore(tokens(CHUNK), kv_for(CHUNK))
    assert eng.closed and eng.storage_manager.closed


def test_close_is_idempotent_and_later_calls_raise(small_config, metadata):
    with LMCacheEngine(small_config(chunk_size=CHUNK), metadata) as eng:
        eng.store(tokens(CHUNK), kv_for(CHUNK))
    eng.close()
    with pytest.raises(ManagerClosedError):
        eng.lookup(tokens(CHUNK))
    with pytest.raises(ManagerClosedError):
        eng.store(tokens(CHUNK), kv_for(CHUNK))


@pytest.mark.parametrize("manager", ["kv", "hs"])
def test_close_on_a_managers_loop_thread_raises_and_leaves_the_engine_closable(make_engine, manager):
    eng = make_engine()
    hs = eng.hidden_state_store
    sm = eng.storage_manager if manager == "kv" else hs.storage_manager

    async def close_on_the_loop() -> None:
        eng.close()

    with pytest.raises(LoopThreadCallError):
        sm.loop_thread.run_sync(close_on_the_loop(), timeout=10)
    assert not eng.closed and not hs.closed
    assert not eng.storage_manager.closed and not hs.storage_manager.closed
    eng.store(tokens(CHUNK), kv_for(CHUNK))  # still open
    eng.close()
    assert eng.closed and hs.closed
    assert eng.storage_manager.pool is None and hs.storage_manager.pool is None  # both pools released


def test_engine_exposes_its_parts(make_engine):
    eng = make_engine(enable_hidden_state_cache=False)
    assert eng.storage_manager.name == "kv"
    assert eng.token_database.chunk_size == CHUNK
    assert eng.hidden_state_store is None
    assert eng.stats()["hidden_states"] is None
    assert "cpu" in eng.stats()["kv"]["tiers"]
    assert "LMCacheEngine" in repr(eng)


def test_default_metadata_is_neutral():
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=1 / 256)
    with LMCacheEngine(cfg) as eng:
        eng.store(tokens(CHUNK), kv_for(CHUNK))
        assert eng.lookup(tokens(CHUNK)) == CHUNK
        assert eng.token_database.keys(tokens(CHUNK))[0].model_name == "default"


def test_an_incremental_store_keeps_the_whole_prompt_ahead_of_its_suffix(make_engine):
    eng = make_engine(max_local_cpu_size=12.5 * _kv_chunk_bytes() / (1 << 30))
    a = tokens(8 * CHUNK, seed=1)
    kv = kv_for(8 * CHUNK, seed=1)
    eng.store(a[: 4 * CHUNK], kv[:, :, : 4 * CHUNK])
    mask = torch.arange(8 * CHUNK) >= 4 * CHUNK
    assert eng.store(a, kv, mask=mask) == 4
    eng.store(tokens(8 * CHUNK, seed=2), kv_for(8 * CHUNK, seed=2))  # evicts 4 chunks of a
    n, got = eng.retrieve(a)
    assert n == 4 * CHUNK and torch.equal(got, kv[:, :, : 4 * CHUNK])


def test_storage_timeouts_are_misses_not_exceptions(make_engine):
    from support import membackend

    membackend.register()
    eng = make_engine(tier_order=["cpu", "testremote"], remote_timeout_s=3, blocking_timeout_secs=0.5)
    membackend.last().mode = "hang"
    toks = tokens(2 * CHUNK, seed=31)
    assert eng.lookup(toks) == 0
    assert eng.retrieve(toks) == (0, None)
    assert eng.stats()["timeouts"] >= 2  # the lookup and the retrieve
    before = eng.stats()["timeouts"]
    # A store asks no lower tier (it skips only what the CPU tier holds): no wait, no timeout.
    assert eng.store(toks, kv_for(2 * CHUNK, seed=31)) == 2  # stored in the CPU tier all the same
    assert eng.stats()["timeouts"] == before


def test_misshaped_first_chunk_is_a_miss(make_engine):
    eng = make_engine()
    toks = tokens(2 * CHUNK, seed=32)
    key = eng.token_database.keys(toks)[0]
    eng.storage_manager.put_sync(key, torch.zeros(2, 2, CHUNK + 1, 8), MemoryFormat.KV_2LTD)  # wrong token count
    assert eng.retrieve(toks) == (0, None)
