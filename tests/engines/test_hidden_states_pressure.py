"""The hidden-state store under SPEC §4.6, continued: pool pressure (a prefix is stored, KV is
never evicted for HS, isolated pools), the storage dtype, retrieve into ``out=``, caller
mistakes, and threads, async twins, stats, clear and close. Configuration, keys, the round
trip, coupled eviction, layers and token offsets are in test_hidden_states.py."""

from __future__ import annotations

import threading

import pytest
import torch
from engines._data import CHUNK, HIDDEN, UNSTORABLE_KINDS, hidden, kv_for, tokens, unstorable
from engines._hs_support import _with_kv

from lmcache_async import HiddenStateStore, LMCacheEngineConfig, LoopThreadCallError, ManagerClosedError


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
