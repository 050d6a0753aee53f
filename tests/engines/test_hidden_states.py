"""The hidden-state store keeps SPEC §4.6: same keys as KV, prefix-strict retrieve coupled to
KV presence, token offsets and the allowlist. Its own pool and LRU, the storage dtype and thread
safety are in test_hidden_states_pressure.py."""

from __future__ import annotations

import pytest
import torch
from engines._data import CHUNK, HIDDEN, hidden, kv_for, tokens
from engines._hs_support import _with_kv

from lmcache_async import HiddenStateStore, LMCacheEngineConfig
from lmcache_async.engines.hidden_states import HS_LAYER_TAG, hs_entry_key


# ---- configuration ---------------------------------------------------------------------------
def test_store_is_none_when_disabled(make_engine):
    eng = make_engine(enable_hidden_state_cache=False)
    assert eng.hidden_state_store is None


def test_disabled_is_the_default():
    assert LMCacheEngineConfig().enable_hidden_state_cache is False


def test_enabled_with_zero_pool_raises_naming_the_key(make_engine):
    with pytest.raises(ValueError, match="max_hidden_state_cpu_size"):
        make_engine(max_hidden_state_cpu_size=0)


def test_standalone_store_with_zero_pool_raises_naming_the_key():
    cfg = LMCacheEngineConfig.from_defaults(max_hidden_state_cpu_size=0, enable_hidden_state_cache=True)
    with pytest.raises(ValueError, match="max_hidden_state_cpu_size"):
        HiddenStateStore(cfg)


def test_hs_pool_is_sized_by_its_own_key(make_engine):
    eng = make_engine(max_hidden_state_cpu_size=1 / 128, max_local_cpu_size=1 / 32)
    hs = eng.hidden_state_store
    assert hs.storage_manager.pool.capacity == (8 << 20)
    assert eng.storage_manager.pool.capacity == (32 << 20)
    assert hs.storage_manager is not eng.storage_manager


def test_hs_lives_in_cpu_memory_even_without_a_kv_cpu_tier(make_engine, memory_tier):
    eng = make_engine(local_cpu=False, tier_order=["cpu", "test-memory"])
    toks = tokens(64)
    assert eng.store(toks, kv_for(64)) == 4
    hs = eng.hidden_state_store
    h = hidden(64)
    assert hs.store_hidden_states(toks, h) == 4
    assert torch.equal(hs.retrieve_hidden_states(toks), h)
    assert hs.storage_manager.tier_names == ["cpu"]


# ---- keys ---------------------------------------------------------------------------------------
def test_chunk_keys_are_the_kv_keys(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(5 * CHUNK)
    _with_kv(eng, toks)
    hs.store_hidden_states(toks, hidden(5 * CHUNK))
    kv_keys = [k for _, _, k in eng.token_database.process_tokens(toks)]
    assert all(eng.storage_manager.contains_sync(k) for k in kv_keys)
    assert all(hs.has_chunk(k) for k in kv_keys)


def test_entry_key_is_the_kv_key_plus_a_layer_tag_and_never_a_kv_key(make_engine):
    eng = make_engine()
    k = eng.token_database.keys(tokens(CHUNK))[0]
    hk = hs_entry_key(k, 3)
    assert hk.to_string() == k.to_string() + "@hs_layer%3"
    assert hk != k and hk.chunk_hash == k.chunk_hash
    assert hk.request_configs == {HS_LAYER_TAG: "3"}
    eng.hidden_state_store.store_hidden_states(tokens(CHUNK), hidden(CHUNK), layer_idx=3)
    assert not eng.storage_manager.contains_sync(hk)  # nothing landed in the KV manager


# ---- round trip ---------------------------------------------------------------------------------
def test_round_trip_returns_contiguous_cpu_float32_prefix(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(4 * CHUNK)
    assert hs.store_hidden_states(toks, h) == 4
    got = hs.retrieve_hidden_states(toks)
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.is_contiguous()
    assert torch.equal(got, h)


def test_retrieve_returns_none_when_nothing_hits(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    assert hs.retrieve_hidden_states(tokens(4 * CHUNK)) is None
    toks = tokens(4 * CHUNK, seed=1)
    hs.store_hidden_states(toks, hidden(4 * CHUNK))
    assert hs.retrieve_hidden_states(toks) is None  # HS without KV is not a hit


def test_retrieve_of_a_longer_prompt_returns_the_cached_prefix(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(6 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(6 * CHUNK)
    hs.store_hidden_states(toks[: 3 * CHUNK], h[: 3 * CHUNK])
    got = hs.retrieve_hidden_states(toks)
    assert torch.equal(got, h[: 3 * CHUNK])


def test_existing_chunk_is_not_copied_again(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(3 * CHUNK)
    assert hs.store_hidden_states(toks, h) == 3
    assert hs.store_hidden_states(toks, h * 2) == 0
    assert torch.equal(hs.retrieve_hidden_states(toks), h)
    assert hs.stats()["chunks_already_present"] == 3
    assert hs.storage_manager.pool.used_bytes == 3 * CHUNK * HIDDEN * 4


def test_device_and_dtype_of_the_input_do_not_matter(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(2 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(2 * CHUNK).to(torch.float16)
    hs.store_hidden_states(toks, h.t().contiguous().t())  # non-contiguous half input
    assert torch.equal(hs.retrieve_hidden_states(toks), h.float())


def test_token_ids_as_a_list_give_the_same_chunks(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(2 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(2 * CHUNK)
    hs.store_hidden_states(toks.tolist(), h)
    assert torch.equal(hs.retrieve_hidden_states(toks), h)


# ---- coupled eviction ----------------------------------------------------------------------------
def test_kv_eviction_truncates_and_drops_the_orphan(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(4 * CHUNK)
    hs.store_hidden_states(toks, h)
    keys = eng.token_database.keys(toks)
    assert eng.storage_manager.remove_sync(keys[2])
    got = hs.retrieve_hidden_states(toks)
    assert torch.equal(got, h[: 2 * CHUNK])
    assert not hs.has_chunk(keys[2])  # the orphan is gone
    assert hs.has_chunk(keys[3])  # past the stop nothing was asked or dropped
    assert hs.stats()["orphans_dropped"] == 1


def test_kv_eviction_under_kv_pressure_shrinks_the_prefix(make_engine):
    per_chunk = 2 * 2 * CHUNK * 8 * 4  # [2, layers=2, CHUNK, 8] float32
    eng = make_engine(max_local_cpu_size=12.5 * per_chunk / (1 << 30))
    hs = eng.hidden_state_store
    a = tokens(8 * CHUNK, seed=1)
    _with_kv(eng, a)
    h = hidden(8 * CHUNK)
    hs.store_hidden_states(a, h)
    b = tokens(8 * CHUNK, seed=2)
    _with_kv(eng, b, seed=2)  # evicts 4 of a's chunks: the suffix, which is least recently used
    assert eng.lookup(a) == 4 * CHUNK
    assert torch.equal(hs.retrieve_hidden_states(a), h[: 4 * CHUNK])


def test_an_hs_hole_truncates(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(4 * CHUNK)
    hs.store_hidden_states(toks, h)
    keys = eng.token_database.keys(toks)
    assert hs.storage_manager.remove_sync(hs_entry_key(keys[1], 0))
    assert torch.equal(hs.retrieve_hidden_states(toks), h[:CHUNK])
    assert eng.lookup(toks) == 4 * CHUNK  # KV is untouched


def test_unknown_kv_answer_stops_the_prefix_but_drops_nothing(make_engine, memory_tier):
    eng = make_engine(tier_order=["cpu", "test-memory"])
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    eng.storage_manager.flush_sync()
    h = hidden(4 * CHUNK)
    hs.store_hidden_states(toks, h)
    keys = eng.token_database.keys(toks)
    eng.storage_manager.backend("cpu").remove_nowait(keys[1])  # KV now only in the lower tier
    (tier,) = memory_tier
    tier.failing = True
    assert torch.equal(hs.retrieve_hidden_states(toks), h[:CHUNK])
    assert hs.has_chunk(keys[1])  # "unknown" is not "gone"
    assert hs.stats()["orphans_dropped"] == 0
    assert hs.stats()["kv_unknown"] >= 1
    tier.failing = False
    assert torch.equal(hs.retrieve_hidden_states(toks), h)


def test_kv_in_a_lower_tier_still_counts(make_engine, memory_tier):
    eng = make_engine(tier_order=["cpu", "test-memory"])
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    _with_kv(eng, toks)
    eng.storage_manager.flush_sync()
    h = hidden(3 * CHUNK)
    hs.store_hidden_states(toks, h)
    for k in eng.token_database.keys(toks):
        eng.storage_manager.backend("cpu").remove_nowait(k)
    assert torch.equal(hs.retrieve_hidden_states(toks), h)


def test_kv_on_the_disk_tier_still_counts(make_engine, tmp_path):
    pytest.importorskip("lmcache_async.disk.tier")
    eng = make_engine(local_disk=str(tmp_path), max_local_disk_size=0.01)
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    _with_kv(eng, toks)
    eng.storage_manager.flush_sync()
    h = hidden(3 * CHUNK)
    hs.store_hidden_states(toks, h)
    for k in eng.token_database.keys(toks):
        eng.storage_manager.backend("cpu").remove_nowait(k)
    assert torch.equal(hs.retrieve_hidden_states(toks), h)


# ---- layers ---------------------------------------------------------------------------------------
def test_layers_are_independent(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    _with_kv(eng, toks)
    h0, h5 = hidden(3 * CHUNK, seed=0), hidden(3 * CHUNK, dim=8, seed=5)
    hs.store_hidden_states(toks, h0, layer_idx=0)
    hs.store_hidden_states(toks[: 2 * CHUNK], h5[: 2 * CHUNK], layer_idx=5)
    assert torch.equal(hs.retrieve_hidden_states(toks, layer_idx=0), h0)
    assert torch.equal(hs.retrieve_hidden_states(toks, layer_idx=5), h5[: 2 * CHUNK])
    assert hs.retrieve_hidden_states(toks, layer_idx=1) is None
    keys = eng.token_database.keys(toks)
    hs.storage_manager.remove_sync(hs_entry_key(keys[0], 5))
    assert hs.retrieve_hidden_states(toks, layer_idx=5) is None
    assert torch.equal(hs.retrieve_hidden_states(toks, layer_idx=0), h0)


def test_allowlist_stores_nothing_for_other_layers(make_engine):
    eng = make_engine(hidden_state_layers=[0, 2])
    hs = eng.hidden_state_store
    toks = tokens(2 * CHUNK)
    _with_kv(eng, toks)
    assert hs.store_hidden_states(toks, hidden(2 * CHUNK), layer_idx=1) == 0
    assert hs.storage_manager.pool.used_bytes == 0
    assert hs.retrieve_hidden_states(toks, layer_idx=1) is None
    assert hs.store_hidden_states(toks, hidden(2 * CHUNK), layer_idx=2) == 2
    assert hs.stats()["filtered_by_allowlist"] == 1


def test_drop_key_drops_every_layer(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(CHUNK)
    for layer in (0, 1, 7):
        hs.store_hidden_states(toks, hidden(CHUNK), layer_idx=layer)
    (k,) = eng.token_database.keys(toks)
    assert hs.drop_key(k)
    assert not any(hs.has_chunk(k, layer) for layer in (0, 1, 7))
    assert not hs.drop_key(k)
    assert hs.storage_manager.pool.used_bytes == 0


def test_coverage_counts_tokens_covered_for_every_layer(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    hs.store_hidden_states(toks, hidden(4 * CHUNK), layer_idx=0)
    hs.store_hidden_states(toks[: 2 * CHUNK], hidden(2 * CHUNK), layer_idx=1)
    assert hs.coverage(toks) == 4 * CHUNK
    assert hs.coverage(toks, layer_idxs=(0, 1)) == 2 * CHUNK
    assert hs.coverage(toks, layer_idxs=[1]) == 2 * CHUNK
    assert hs.coverage(toks, layer_idxs=(2,)) == 0
    keys = eng.token_database.keys(toks)
    eng.storage_manager.remove_sync(keys[0])
    assert hs.coverage(toks) == 0
    assert not hs.has_chunk(keys[0], 0) and not hs.has_chunk(keys[0], 1)
    with pytest.raises(ValueError, match="layer_idxs"):
        hs.coverage(toks, layer_idxs=())


# ---- token offsets and chunk rules -----------------------------------------------------------
def test_incremental_store_with_token_offset_retrieves_the_whole_prefix(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(6 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(6 * CHUNK)
    assert hs.store_hidden_states(toks[: 2 * CHUNK], h[: 2 * CHUNK]) == 2
    assert hs.store_hidden_states(toks, h[2 * CHUNK :], token_offset=2 * CHUNK) == 4
    assert torch.equal(hs.retrieve_hidden_states(toks), h)


def test_chunk_straddling_the_offset_is_skipped(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(4 * CHUNK)
    off = CHUNK + 5
    assert hs.store_hidden_states(toks[:off], h[:off]) == 1  # only chunk 0 is whole
    assert hs.store_hidden_states(toks, h[off:], token_offset=off) == 2  # chunk 1 straddles
    keys = eng.token_database.keys(toks)
    assert [hs.has_chunk(k) for k in keys] == [True, False, True, True]
    assert torch.equal(hs.retrieve_hidden_states(toks), h[:CHUNK])


def test_offset_equal_to_the_prompt_stores_nothing(make_engine):
    hs = make_engine().hidden_state_store
    toks = tokens(2 * CHUNK)
    assert hs.store_hidden_states(toks, hidden(0), token_offset=2 * CHUNK) == 0


def test_save_unfull_chunk_false_ignores_the_tail(make_engine):
    eng = make_engine(save_unfull_chunk=False)
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK + 7)
    _with_kv(eng, toks)
    h = hidden(3 * CHUNK + 7)
    assert hs.store_hidden_states(toks, h) == 3
    assert torch.equal(hs.retrieve_hidden_states(toks), h[: 3 * CHUNK])
    assert hs.coverage(toks) == 3 * CHUNK


def test_save_unfull_chunk_true_keeps_the_tail(make_engine):
    eng = make_engine(save_unfull_chunk=True)
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK + 7)
    _with_kv(eng, toks)
    h = hidden(3 * CHUNK + 7)
    assert hs.store_hidden_states(toks, h) == 4
    assert torch.equal(hs.retrieve_hidden_states(toks), h)
