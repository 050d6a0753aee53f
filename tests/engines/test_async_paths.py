"""The engines' coroutines: CPU-tier work stays on the caller's thread, large copies leave the
caller's loop, and a cancelled coroutine holds no pool memory afterwards."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from engines._data import CHUNK, HIDDEN, hidden, kv_for, tokens

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache_async.engines import _chunks, _offload, hidden_states, kv
from lmcache_async.engines.encoder_cache import ECCacheEngine


class ThreadLog:
    """Wraps the engines' copy helpers to record the thread each copy ran on."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def wrap(self, fn: Callable[..., bool]) -> Callable[..., bool]:
        def recorded(*args: Any) -> bool:
            self.threads.append(threading.current_thread())
            return fn(*args)

        return recorded


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> ThreadLog:
    log = ThreadLog()
    for mod in (kv, hidden_states):
        monkeypatch.setattr(mod, "copy_in", log.wrap(_chunks.copy_in))
        monkeypatch.setattr(mod, "copy_out", log.wrap(_chunks.copy_out))
    return log


@pytest.fixture
def no_offload(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any use of the copy executor fails the test."""

    def refuse(fn: Callable[[], Any]) -> Any:
        raise AssertionError("the copy left the caller's thread")

    monkeypatch.setattr(_offload, "run_off_loop", refuse)
    yield


@pytest.fixture
def tiny_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy counts as large (test data stays small)."""
    monkeypatch.setattr(_offload, "OFF_LOOP_COPY_BYTES", 1)


def _refuse_loop_crossings(monkeypatch: pytest.MonkeyPatch, *managers: Any) -> None:
    """Any crossing to a manager's loop thread fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        for a in args:
            if asyncio.iscoroutine(a):
                a.close()
        raise AssertionError("the call crossed to a manager's loop thread")

    for sm in managers:
        for name in ("submit", "run_sync", "run_async"):
            monkeypatch.setattr(sm.loop_thread, name, refuse)


async def test_cpu_hits_are_answered_on_the_callers_thread(make_engine, copies, no_offload, monkeypatch):
    eng = make_engine()
    hs = eng.hidden_state_store
    _refuse_loop_crossings(monkeypatch, eng.storage_manager, hs.storage_manager)
    toks = tokens(3 * CHUNK, seed=40)
    me = threading.current_thread()
    assert await eng.astore(toks, kv_for(3 * CHUNK, seed=40)) == 3
    assert await hs.astore_hidden_states(toks, hidden(3 * CHUNK, seed=40)) == 3
    n, got = await eng.aretrieve(toks)
    assert n == 3 * CHUNK and torch.equal(got, kv_for(3 * CHUNK, seed=40))
    assert torch.equal(await hs.aretrieve_hidden_states(toks), hidden(3 * CHUNK, seed=40))
    assert await eng.alookup(toks) == 3 * CHUNK
    assert await hs.acoverage(toks) == 3 * CHUNK
    assert len(copies.threads) == 12  # 3 chunks in and out, KV and HS
    assert all(t is me for t in copies.threads)


async def test_large_copies_run_off_the_loop_which_keeps_serving(make_engine, copies, tiny_threshold):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK, seed=41)
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        results = []
        for call in (
            lambda: eng.astore(toks, kv_for(4 * CHUNK, seed=41)),
            lambda: hs.astore_hidden_states(toks, hidden(4 * CHUNK, seed=41)),
            lambda: eng.aretrieve(toks),
            lambda: hs.aretrieve_hidden_states(toks),
        ):
            before = ticks
            results.append(await call())
            assert ticks > before  # the loop ran the ticker while the copy was in flight
    finally:
        stop.set()
        await task
    assert results[0] == 4 and results[1] == 4
    assert results[2][0] == 4 * CHUNK and torch.equal(results[2][1], kv_for(4 * CHUNK, seed=41))
    assert torch.equal(results[3], hidden(4 * CHUNK, seed=41))
    me = threading.current_thread()
    assert copies.threads and all(t is not me for t in copies.threads)
    assert all(t.name.startswith("lmcache-async-engine-copy") for t in copies.threads)


def _in_use(pool: Any) -> int:
    return int(pool.stats()["objects"])


async def test_cancelled_retrieve_mid_copy_leaks_no_buffer(make_engine, monkeypatch, tiny_threshold):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK, seed=42)
    eng.store(toks, kv_for(4 * CHUNK, seed=42))
    hs.store_hidden_states(toks, hidden(4 * CHUNK, seed=42))
    hs_pool, kv_pool = hs.storage_manager.pool, eng.storage_manager.pool
    entries = (_in_use(hs_pool), _in_use(kv_pool))
    started, release = threading.Event(), threading.Event()

    def blocking_copy_out(dst: torch.Tensor, src: torch.Tensor) -> bool:
        started.set()
        assert release.wait(30)
        return _chunks.copy_out(dst, src)

    for mod in (kv, hidden_states):
        monkeypatch.setattr(mod, "copy_out", blocking_copy_out)
    for call in (lambda: hs.aretrieve_hidden_states(toks), lambda: eng.aretrieve(toks)):
        started.clear()
        release.clear()
        task = asyncio.ensure_future(call())
        while not started.is_set():  # the copy is running on the executor, references held
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(3000):  # the abandoned copy finishes and gives its references back
            refs = [o.get_ref_count() for sm in (hs.storage_manager, eng.storage_manager) for o in _held(sm, toks, eng)]
            if all(r == 1 for r in refs):
                break
            await asyncio.sleep(0.01)
        assert all(r == 1 for r in refs), refs
    assert (_in_use(hs_pool), _in_use(kv_pool)) == entries
    hs.clear()
    eng.storage_manager.clear_sync()
    assert _in_use(hs_pool) == 0 and _in_use(kv_pool) == 0


def _held(sm: Any, toks: torch.Tensor, eng: Any) -> list[Any]:
    """The index's entries of ``toks`` (KV or HS layer 0), each with the reference this look
    took already given back: what is left is the index's own plus any other holder's."""
    keys = eng.token_database.keys(toks)
    if sm.name == "hs":
        keys = [hidden_states.hs_entry_key(k, 0) for k in keys]
    objs = [o for o in sm.batched_get_sync(keys) if o is not None]
    for o in objs:
        o.ref_count_down()
    return objs


async def test_cancelled_store_mid_copy_finishes_and_leaks_no_buffer(make_engine, monkeypatch, tiny_threshold):
    eng = make_engine()
    hs = eng.hidden_state_store
    toks = tokens(4 * CHUNK, seed=43)
    eng.store(toks, kv_for(4 * CHUNK, seed=43))
    started, release = threading.Event(), threading.Event()

    def blocking_copy_in(dst: torch.Tensor, src: torch.Tensor) -> bool:
        started.set()
        assert release.wait(30)
        return _chunks.copy_in(dst, src)

    monkeypatch.setattr(hidden_states, "copy_in", blocking_copy_in)
    task = asyncio.ensure_future(hs.astore_hidden_states(toks, hidden(4 * CHUNK, seed=43)))
    while not started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    for _ in range(3000):
        if hs.stats()["stores"] == 1:
            break
        await asyncio.sleep(0.01)
    assert hs.stats()["chunks_stored"] == 4  # the store ran to its end: every chunk indexed
    assert all(o.get_ref_count() == 1 for o in _held(hs.storage_manager, toks, eng))
    assert torch.equal(hs.retrieve_hidden_states(toks), hidden(4 * CHUNK, seed=43))
    hs.clear()
    assert _in_use(hs.storage_manager.pool) == 0


async def test_async_retrieve_timeouts_are_misses(make_engine):
    from support import membackend

    membackend.register()
    eng = make_engine(tier_order=["cpu", "testremote"], remote_timeout_s=3, blocking_timeout_secs=0.5)
    membackend.last().mode = "hang"
    toks = tokens(2 * CHUNK, seed=44)
    assert await eng.alookup(toks) == 0
    assert await eng.aretrieve(toks) == (0, None)
    assert eng.stats()["timeouts"] >= 2


def _ec(pool_mib: int = 16) -> ECCacheEngine:
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=pool_mib / 1024, staging_size=0)
    return ECCacheEngine(cfg, LMCacheEngineMetadata("ec-async"), torch.bfloat16)


async def test_ec_small_entries_stay_on_the_callers_thread(monkeypatch, no_offload):
    engine = _ec()
    try:
        t = torch.randn(8, HIDDEN)
        assert await engine.aput("small", t)
        got = await engine.aget("small")
        assert got is not None
        assert torch.equal(got, t)
    finally:
        await engine.aclose()


async def test_ec_large_entries_are_copied_off_the_loop(monkeypatch, tiny_threshold):
    seen: list[threading.Thread] = []
    engine = _ec()
    real = engine._copy_out

    def recorded(obj: Any, dev: torch.device) -> Any:
        seen.append(threading.current_thread())
        return real(obj, dev)

    monkeypatch.setattr(engine, "_copy_out", recorded)
    try:
        t = torch.randn(64, HIDDEN)
        assert await engine.aput("large", t)
        got = await engine.aget("large")
        assert got is not None
        assert torch.equal(got, t)
        assert seen and seen[0] is not threading.current_thread()
        pool = engine.storage_manager.pool
        assert pool is not None and _in_use(pool) == 1  # only the index holds the entry
    finally:
        await engine.aclose()
