"""The hidden-state store keeps SPEC §4.6: same keys as KV, prefix-strict retrieve coupled to
KV presence, its own pool and LRU, token offsets, allowlist, storage dtype, thread safety."""

from __future__ import annotations

import threading

import pytest
import torch
from engines._data import CHUNK, HIDDEN, UNSTORABLE_KINDS, hidden, kv_for, tokens, unstorable

from lmcache_async import HiddenStateStore, LMCacheEngineConfig, LoopThreadCallError, ManagerClosedError
from lmcache_async.engines.hidden_states import HS_LAYER_TAG, hs_entry_key


def _with_kv(eng, toks, seed=0):
    """Store KV for the whole prompt (the thinker's KV) so HS chunks count as covered."""
    eng.store(toks, kv_for(len(toks), seed=seed))


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


# ---- pool pressure -----------------------------------------------------------------------------
def _chunk_bytes(dim=HIDDEN, itemsize=4):
    return CHUNK * dim * itemsize


def test_pool_smaller_than_the_prompt_stores_a_prefix_and_returns_its_count(make_engine):
    eng = make_engine(max_hidden_state_cpu_size=10.5 * _chunk_bytes() / (1 << 30))
    hs = eng.hidden_state_store
    other = tokens(4 * CHUNK, seed=9)
    hs.store_hidden_states(other, hidden(4 * CHUNK, seed=9))  # older entries, evictable
    toks = tokens(16 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(16 * CHUNK)
    n = hs.store_hidden_states(toks, h)
    assert n == 10
    assert torch.equal(hs.retrieve_hidden_states(toks), h[: 10 * CHUNK])
    assert hs.stats()["stores_truncated"] == 1
    assert hs.coverage(other) == 0  # the older prompt made room


def test_hs_pressure_never_evicts_kv(make_engine):
    eng = make_engine(max_hidden_state_cpu_size=8.5 * _chunk_bytes() / (1 << 30))
    hs = eng.hidden_state_store
    prompts = [tokens(4 * CHUNK, seed=s) for s in range(6)]
    for s, p in enumerate(prompts):
        _with_kv(eng, p, seed=s)
        hs.store_hidden_states(p, hidden(4 * CHUNK, seed=s))
    assert hs.stats()["evictions"] > 0
    assert all(eng.lookup(p) == 4 * CHUNK for p in prompts)
    assert eng.storage_manager.stats()["tiers"]["cpu"]["evictions"] == 0


def test_retrieve_touches_the_prefix_so_it_outlives_its_suffix(make_engine):
    eng = make_engine(max_hidden_state_cpu_size=8.5 * _chunk_bytes() / (1 << 30))
    hs = eng.hidden_state_store
    a, b = tokens(4 * CHUNK, seed=1), tokens(4 * CHUNK, seed=2)
    _with_kv(eng, a, seed=1)
    _with_kv(eng, b, seed=2)
    ha = hidden(4 * CHUNK, seed=1)
    hs.store_hidden_states(a, ha)
    hs.store_hidden_states(b, hidden(4 * CHUNK, seed=2))
    hs.retrieve_hidden_states(a)  # a is now more recent than b
    c = tokens(2 * CHUNK, seed=3)
    hs.store_hidden_states(c, hidden(2 * CHUNK, seed=3))  # evicts two chunks: b's suffix
    assert torch.equal(hs.retrieve_hidden_states(a), ha)
    assert hs.coverage(b) == 2 * CHUNK


def test_two_stores_have_isolated_pools(make_engine):
    size = 6.5 * _chunk_bytes() / (1 << 30)
    e1, e2 = make_engine(max_hidden_state_cpu_size=size), make_engine(max_hidden_state_cpu_size=size)
    hs1, hs2 = e1.hidden_state_store, e2.hidden_state_store
    assert hs1.storage_manager.pool is not hs2.storage_manager.pool
    toks = tokens(4 * CHUNK)
    _with_kv(e1, toks)
    _with_kv(e2, toks)
    h = hidden(4 * CHUNK)
    hs2.store_hidden_states(toks, h)
    for s in range(1, 5):  # pressure on the first store only
        hs1.store_hidden_states(tokens(4 * CHUNK, seed=s), hidden(4 * CHUNK, seed=s))
    assert hs1.stats()["evictions"] > 0
    assert hs2.stats()["evictions"] == 0
    assert torch.equal(hs2.retrieve_hidden_states(toks), h)
    assert hs1.retrieve_hidden_states(toks) is None


# ---- storage dtype -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_storage_dtypes_halve_memory_and_retrieve_float32(make_engine, name, dtype):
    eng = make_engine(hidden_state_storage_dtype=name)
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(4 * CHUNK)
    hs.store_hidden_states(toks, h)
    assert hs.storage_manager.pool.used_bytes == 4 * _chunk_bytes(itemsize=2)
    got = hs.retrieve_hidden_states(toks)
    assert got.dtype == torch.float32
    assert torch.equal(got, h.to(dtype).float())
    assert hs.stats()["storage_dtype"] == name


# ---- out= ---------------------------------------------------------------------------------------
def test_out_is_filled_and_its_view_returned(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    _with_kv(eng, toks)
    h = hidden(3 * CHUNK)
    hs.store_hidden_states(toks, h)
    buf = torch.full((5 * CHUNK, HIDDEN), -1.0)
    got = hs.retrieve_hidden_states(toks, out=buf)
    assert got.data_ptr() == buf.data_ptr() and got.shape == (3 * CHUNK, HIDDEN)
    assert torch.equal(buf[: 3 * CHUNK], h)
    assert bool((buf[3 * CHUNK :] == -1).all())


def test_out_is_untouched_on_a_miss(make_engine):
    hs = make_engine().hidden_state_store
    buf = torch.full((CHUNK, HIDDEN), -1.0)
    assert hs.retrieve_hidden_states(tokens(CHUNK), out=buf) is None
    assert bool((buf == -1).all())


def test_out_too_small_or_of_the_wrong_kind_is_a_value_error(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    _with_kv(eng, toks)
    hs.store_hidden_states(toks, hidden(3 * CHUNK))
    with pytest.raises(ValueError, match=f"at least {3 * CHUNK} rows"):
        hs.retrieve_hidden_states(toks, out=torch.empty(2 * CHUNK, HIDDEN))
    with pytest.raises(ValueError, match=f"{HIDDEN} columns"):
        hs.retrieve_hidden_states(toks, out=torch.empty(3 * CHUNK, HIDDEN + 1))
    with pytest.raises(ValueError, match="float32"):
        hs.retrieve_hidden_states(toks, out=torch.empty(3 * CHUNK, HIDDEN, dtype=torch.float16))
    with pytest.raises(TypeError, match="out"):
        hs.retrieve_hidden_states(toks, out=[0.0])
    assert hs.storage_manager.pool.stats()["objects"] == 3  # no leaked references


# ---- caller mistakes ----------------------------------------------------------------------------
def test_hidden_states_must_be_2d(make_engine):
    hs = make_engine().hidden_state_store
    with pytest.raises(ValueError, match="2-D"):
        hs.store_hidden_states(tokens(CHUNK), torch.zeros(CHUNK))
    with pytest.raises(ValueError, match="2-D"):
        hs.store_hidden_states(tokens(CHUNK), torch.zeros(1, CHUNK, HIDDEN))
    with pytest.raises(TypeError, match="hidden_states"):
        hs.store_hidden_states(tokens(CHUNK), [[0.0]])
    with pytest.raises(TypeError, match="floating"):
        hs.store_hidden_states(tokens(CHUNK), torch.zeros(CHUNK, HIDDEN, dtype=torch.int32))


@pytest.mark.parametrize("kind", UNSTORABLE_KINDS)
def test_store_of_a_tensor_without_dense_bytes_is_a_type_error_naming_hidden_states(make_engine, kind):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(2 * CHUNK, seed=5)
    _with_kv(eng, toks)
    with pytest.raises(TypeError, match=r"^hidden_states "):
        hs.store_hidden_states(toks, unstorable(kind, (2 * CHUNK, HIDDEN)))
    assert hs.retrieve_hidden_states(toks) is None


def test_lmcache_call_shape_with_a_positional_token_database_is_a_type_error_naming_metadata(make_engine):
    eng = make_engine(enable_hidden_state_cache=False)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_hidden_state_cpu_size=1 / 256)
    with pytest.raises(TypeError, match=r"metadata \(the second positional argument\).*token_database="):
        HiddenStateStore(cfg, eng.token_database)
    with pytest.raises(TypeError, match=r"metadata \(the second positional argument\).*got str"):
        HiddenStateStore(cfg, "test-model")  # type: ignore[arg-type]


@pytest.mark.parametrize("offset", [-1, 2 * CHUNK + 1])
def test_offset_outside_the_prompt_is_a_value_error(make_engine, offset):
    hs = make_engine().hidden_state_store
    with pytest.raises(ValueError, match=rf"token_offset must be in \[0, len\(token_ids\)={2 * CHUNK}\]"):
        hs.store_hidden_states(tokens(2 * CHUNK), hidden(CHUNK), token_offset=offset)


def test_row_count_mismatch_says_what_was_expected(make_engine):
    hs = make_engine().hidden_state_store
    with pytest.raises(ValueError, match=r"expected len\(token_ids\) - token_offset = 32 - 4 = 28"):
        hs.store_hidden_states(tokens(2 * CHUNK), hidden(2 * CHUNK), token_offset=4)


def test_bad_layer_and_token_ids(make_engine):
    hs = make_engine().hidden_state_store
    with pytest.raises(ValueError, match="layer_idx"):
        hs.store_hidden_states(tokens(CHUNK), hidden(CHUNK), layer_idx=-1)
    with pytest.raises(TypeError, match="layer_idx"):
        hs.retrieve_hidden_states(tokens(CHUNK), layer_idx="0")
    with pytest.raises(TypeError, match="token_ids"):
        hs.store_hidden_states(torch.zeros(CHUNK), hidden(CHUNK))
    with pytest.raises(ValueError, match="1-D"):
        hs.retrieve_hidden_states(torch.zeros(2, CHUNK, dtype=torch.int64))
    with pytest.raises(TypeError, match="key"):
        hs.has_chunk("not a key")


# ---- concurrency, async, lifecycle ------------------------------------------------------------
def test_eight_threads_storing_and_retrieving_different_prompts_stay_correct(make_engine):
    eng = make_engine(max_hidden_state_cpu_size=1 / 16, max_local_cpu_size=1 / 16)
    hs = eng.hidden_state_store
    n_threads, rounds = 8, 12
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait(timeout=30)
            for r in range(rounds):
                seed = t * 100 + r
                n = (2 + (seed % 5)) * CHUNK
                toks, h = tokens(n, seed=seed), hidden(n, seed=seed)
                eng.store(toks, kv_for(n, seed=seed))
                half = (n // CHUNK // 2) * CHUNK
                hs.store_hidden_states(toks[:half], h[:half], layer_idx=t % 2)
                hs.store_hidden_states(toks, h[half:], layer_idx=t % 2, token_offset=half)
                got = hs.retrieve_hidden_states(toks, layer_idx=t % 2)
                assert got is not None and torch.equal(got, h), f"thread {t} round {r}"
                assert hs.coverage(toks, (t % 2,)) == n
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors[0]
    assert hs.stats()["stores"] == 2 * n_threads * rounds


async def test_async_twins_from_an_event_loop(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(3 * CHUNK)
    await eng.astore(toks, kv_for(3 * CHUNK))
    h = hidden(3 * CHUNK)
    assert await hs.astore_hidden_states(toks, h) == 3
    assert torch.equal(await hs.aretrieve_hidden_states(toks), h)
    buf = torch.empty(3 * CHUNK, HIDDEN)
    assert (await hs.aretrieve_hidden_states(toks, out=buf)).data_ptr() == buf.data_ptr()
    assert await hs.acoverage(toks) == 3 * CHUNK
    (k, *_) = eng.token_database.keys(toks)
    assert await hs.ahas_chunk(k)
    assert await hs.adrop_key(k)
    assert await hs.aretrieve_hidden_states(toks) is None


def test_stats_report_counters_and_the_pool(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(2 * CHUNK)
    _with_kv(eng, toks)
    hs.store_hidden_states(toks, hidden(2 * CHUNK), layer_idx=1)
    hs.retrieve_hidden_states(toks, layer_idx=1)
    hs.retrieve_hidden_states(toks, layer_idx=2)
    st = hs.stats()
    assert st["stores"] == 1 and st["chunks_stored"] == 2
    assert st["retrieves"] == 2 and st["retrieve_hits"] == 1 and st["hit_tokens"] == 2 * CHUNK
    assert st["entries"] == 2 and st["layers"] == [1]
    assert st["pool"]["capacity_bytes"] == 16 << 20
    assert eng.stats()["hidden_states"]["entries"] == 2


def test_clear_returns_the_pool_to_zero(make_engine):
    hs = make_engine().hidden_state_store
    hs.store_hidden_states(tokens(2 * CHUNK), hidden(2 * CHUNK))
    hs.clear()
    assert hs.storage_manager.pool.used_bytes == 0


def test_calls_after_close_raise_and_close_is_idempotent(make_engine):
    eng = make_engine()
    hs = eng.hidden_state_store
    eng.close()
    assert hs.closed
    hs.close()
    with pytest.raises(ManagerClosedError):
        hs.retrieve_hidden_states(tokens(CHUNK))
    with pytest.raises(ManagerClosedError):
        hs.store_hidden_states(tokens(CHUNK), hidden(CHUNK))


def test_close_on_its_loop_thread_raises_and_leaves_the_store_closable():
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_hidden_state_cpu_size=1 / 256)
    hs = HiddenStateStore(cfg)
    sm = hs.storage_manager

    async def close_on_the_loop() -> None:
        hs.close()

    try:
        with pytest.raises(LoopThreadCallError):
            sm.loop_thread.run_sync(close_on_the_loop(), timeout=10)
        assert not hs.closed and not sm.closed
        toks = tokens(CHUNK)
        assert hs.store_hidden_states(toks, hidden(CHUNK)) == 1  # still open
    finally:
        hs.close()
    assert hs.closed and sm.closed and sm.pool is None


def test_standalone_store_without_kv_manager_checks_hs_only():
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_hidden_state_cpu_size=1 / 256)
    with HiddenStateStore(cfg) as hs:
        toks = tokens(2 * CHUNK)
        h = hidden(2 * CHUNK)
        hs.store_hidden_states(toks, h)
        got = hs.retrieve_hidden_states(toks)
        assert got is not None
        assert torch.equal(got, h)


def test_an_incremental_store_keeps_the_part_before_the_offset_ahead_of_the_suffix(make_engine):
    eng = make_engine(max_hidden_state_cpu_size=8.5 * _chunk_bytes() / (1 << 30))
    hs = eng.hidden_state_store
    a = tokens(6 * CHUNK, seed=1)
    _with_kv(eng, a, seed=1)
    h = hidden(6 * CHUNK, seed=1)
    hs.store_hidden_states(a[: 2 * CHUNK], h[: 2 * CHUNK])
    hs.store_hidden_states(a, h[2 * CHUNK :], token_offset=2 * CHUNK)
    b = tokens(4 * CHUNK, seed=2)
    hs.store_hidden_states(b, hidden(4 * CHUNK, seed=2))  # evicts two of a's chunks
    assert torch.equal(hs.retrieve_hidden_states(a), h[: 4 * CHUNK])


def test_threads_under_pool_pressure_only_ever_see_correct_prefixes(make_engine):
    eng = make_engine(
        max_hidden_state_cpu_size=24.5 * _chunk_bytes() / (1 << 30),
        max_local_cpu_size=40.5 * 2 * 2 * CHUNK * 8 * 4 / (1 << 30),
    )
    hs = eng.hidden_state_store
    n_threads, rounds = 8, 10
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def work(t: int) -> None:
        try:
            barrier.wait(timeout=30)
            for r in range(rounds):
                seed = t * 100 + r
                n = 6 * CHUNK
                toks, h = tokens(n, seed=seed), hidden(n, seed=seed)
                eng.store(toks, kv_for(n, seed=seed))
                hs.store_hidden_states(toks, h)
                for _ in range(2):
                    got = hs.retrieve_hidden_states(toks)
                    if got is not None:
                        assert got.shape[0] % CHUNK == 0
                        assert torch.equal(got, h[: got.shape[0]]), f"thread {t} round {r}"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors[0]
    assert hs.stats()["evictions"] > 0
    assert hs.storage_manager.pool.used_bytes <= hs.storage_manager.pool.capacity


def test_incremental_store_under_pressure_keeps_the_earlier_chunks(make_engine):
    per_chunk = CHUNK * HIDDEN * 4
    eng = make_engine(max_hidden_state_cpu_size=6 * per_chunk / (1 << 30))  # room for 6 chunks
    hs = eng.hidden_state_store
    toks = tokens(8 * CHUNK, seed=21)
    _with_kv(eng, toks, seed=21)
    h = hidden(8 * CHUNK, seed=21)
    assert hs.store_hidden_states(toks[: 4 * CHUNK], h[: 4 * CHUNK]) == 4
    stored = hs.store_hidden_states(toks, h[4 * CHUNK :], token_offset=4 * CHUNK)
    assert stored == 2  # only what fits beside the held prefix
    got = hs.retrieve_hidden_states(toks)
    assert got is not None and got.shape[0] == 6 * CHUNK
    assert torch.equal(got, h[: 6 * CHUNK])


def test_allowlist_does_not_hide_caller_mistakes(make_engine):
    eng = make_engine(hidden_state_layers=[0])
    hs = eng.hidden_state_store
    toks = tokens(2 * CHUNK)
    with pytest.raises(TypeError):
        hs.store_hidden_states(toks, "junk", layer_idx=5)
    with pytest.raises(ValueError):
        hs.store_hidden_states(toks, hidden(2 * CHUNK), layer_idx=5, token_offset=-3)
    assert hs.store_hidden_states(toks, hidden(2 * CHUNK), layer_idx=5) == 0
