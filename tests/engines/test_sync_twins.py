"""Each engine operation is one coroutine; its blocking method is derived from it
(:func:`lmcache_async.engines._twins.blocking_twin`): same signature, same results, same errors,
same counters. The blocking form runs on the caller's thread (no loop crossing for CPU-tier work,
every copy inline), and every public coroutine gives its loop a turn."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from engines._data import CHUNK, HIDDEN, hidden, kv_for, tokens

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache_async.engines import _chunks, _offload, hidden_states, kv
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.engines.kv import LMCacheEngine
from lmcache_async.errors import LoopThreadCallError

EngineFactory = Callable[..., LMCacheEngine]

# The blocking name of every engine operation (its coroutine is "a" + name).
PAIRS: dict[type, tuple[str, ...]] = {
    LMCacheEngine: ("store", "retrieve", "lookup"),
    HiddenStateStore: (
        "store_hidden_states",
        "retrieve_hidden_states",
        "coverage",
        "has_chunk",
        "drop_key",
        "clear",
    ),
    ECCacheEngine: ("put", "get", "contains", "delete", "flush"),
}


@pytest.mark.parametrize(("cls", "name"), [(c, n) for c, names in PAIRS.items() for n in names])
def test_every_blocking_method_is_derived_from_its_coroutine(cls: type, name: str) -> None:
    blocking, coro = getattr(cls, name), getattr(cls, "a" + name)
    assert inspect.iscoroutinefunction(coro)
    assert not inspect.iscoroutinefunction(blocking)
    assert blocking.__wrapped__ is coro  # one body: the blocking form steps the coroutine
    assert inspect.signature(blocking) == inspect.signature(coro)
    assert blocking.__name__ == name and blocking.__qualname__ == f"{cls.__name__}.{name}"
    assert f":meth:`a{name}`" in (blocking.__doc__ or "")


def test_flush_and_aflush_take_the_same_arguments() -> None:
    sync, coro = inspect.signature(ECCacheEngine.flush), inspect.signature(ECCacheEngine.aflush)
    assert sync == coro
    assert list(sync.parameters) == ["self", "timeout"]
    assert sync.parameters["timeout"].default is None


def _ec(**overrides: Any) -> ECCacheEngine:
    base: dict[str, Any] = {"max_local_cpu_size": 16 / 1024, "staging_size": 1 / 256}
    base.update(overrides)
    return ECCacheEngine(LMCacheEngineConfig.from_defaults(**base), LMCacheEngineMetadata("twins-ec"), torch.bfloat16)


def test_flush_timeout_bounds_both_forms_alike() -> None:
    from support import membackend

    membackend.register()
    ec = _ec(tier_order=["cpu", "testmem"])
    try:
        tier = membackend.last()
        tier.delay = 1.0  # every lower-tier write takes a second
        assert ec.put("slow", torch.ones(4, 8))
        with pytest.raises(TimeoutError):
            ec.flush(timeout=0.05)
        with pytest.raises(TimeoutError):
            asyncio.run(ec.aflush(timeout=0.05))
        asyncio.run(ec.aflush(timeout=30))  # the write went on; both forms wait for it
        ec.flush(30)
        assert tier.puts == 1
        tier.delay = 0.0
    finally:
        ec.close()


# ---- the same script through the blocking methods and through the coroutines ------------------
Call = tuple[str, tuple[Any, ...], dict[str, Any]]


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return _plain(fn(*args, **kwargs))
    except Exception as exc:  # the error is part of the result
        return ("raised", type(exc).__name__, str(exc))


async def _aoutcome(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return _plain(await fn(*args, **kwargs))
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


def _plain(v: Any) -> Any:
    """Results made comparable: tensors by dtype, shape and values."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), v.cpu().tolist())
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x) for x in v)
    return v


def _both(
    make: Callable[[], Any], script: Callable[[Any], list[tuple[Any, str, tuple[Any, ...], dict[str, Any]]]]
) -> None:
    """Runs ``script``'s calls on one fresh object blockingly and on another through the coroutines."""
    sync_obj, async_obj = make(), make()
    sync_out = [_outcome(getattr(t, n), a, k) for t, n, a, k in script(sync_obj)]

    async def run_all() -> list[Any]:
        return [await _aoutcome(getattr(t, "a" + n), a, k) for t, n, a, k in script(async_obj)]

    async_out = asyncio.run(run_all())
    assert len(sync_out) == len(async_out)
    for i, (s, a) in enumerate(zip(sync_out, async_out, strict=True)):
        assert s == a, f"call {i}: blocking {s!r} != awaited {a!r}"


def _kv_hs_script(eng: LMCacheEngine) -> list[tuple[Any, str, tuple[Any, ...], dict[str, Any]]]:
    hs = eng.hidden_state_store
    a, b, miss = tokens(3 * CHUNK, seed=60), tokens(2 * CHUNK, seed=61), tokens(2 * CHUNK, seed=62)
    keys = eng.token_database.keys(a)
    mask = torch.tensor([False] * CHUNK + [True] * CHUNK)
    return [
        (eng, "store", (a, kv_for(3 * CHUNK, seed=60)), {}),
        (eng, "store", (a, kv_for(3 * CHUNK, seed=60)), {}),
        (eng, "store", (b, kv_for(CHUNK, seed=61)), {"mask": mask}),
        (eng, "store", (b, "not a tensor"), {}),
        (eng, "lookup", (a,), {}),
        (eng, "lookup", (b,), {}),
        (eng, "lookup", (miss,), {}),
        (eng, "retrieve", (a,), {}),
        (eng, "retrieve", (miss,), {}),
        (eng, "retrieve", (a,), {"device": "meta"}),
        (hs, "store_hidden_states", (a, hidden(3 * CHUNK, seed=60)), {}),
        (hs, "store_hidden_states", (a, hidden(3 * CHUNK, seed=60)), {}),
        (hs, "store_hidden_states", (a, hidden(2 * CHUNK, seed=63)), {"layer_idx": 1, "token_offset": CHUNK}),
        (hs, "store_hidden_states", (a, hidden(CHUNK)), {}),
        (hs, "retrieve_hidden_states", (a,), {}),
        (hs, "retrieve_hidden_states", (a, 1), {}),
        (hs, "retrieve_hidden_states", (a,), {"out": torch.zeros(4 * CHUNK, HIDDEN)}),
        (hs, "retrieve_hidden_states", (a, -1), {}),
        (hs, "coverage", (a,), {}),
        (hs, "coverage", (a, (0, 1)), {}),
        (hs, "coverage", (a, ()), {}),
        (hs, "has_chunk", (keys[0],), {}),
        (hs, "has_chunk", (keys[0], 1), {}),
        (hs, "has_chunk", ("not a key",), {}),
        (hs, "drop_key", (keys[2],), {}),
        (hs, "drop_key", (keys[2],), {}),
        (hs, "coverage", (a,), {}),
        (hs, "clear", (), {}),
        (hs, "retrieve_hidden_states", (a,), {}),
    ]


def _counters(eng: LMCacheEngine) -> tuple[Any, ...]:
    hs = eng.hidden_state_store
    assert hs is not None
    hs_stats = {k: v for k, v in hs.stats().items() if k != "pool"}
    kv_tiers = eng.stats()["kv"]["tiers"]["cpu"]
    return eng.timeouts, hs_stats, kv_tiers["entries"], kv_tiers["bytes"]


def test_kv_and_hs_blocking_methods_give_what_their_coroutines_give(make_engine: EngineFactory) -> None:
    made: list[LMCacheEngine] = []

    def make() -> LMCacheEngine:
        made.append(make_engine())
        return made[-1]

    _both(make, _kv_hs_script)
    assert _counters(made[0]) == _counters(made[1])


def _ec_script(ec: ECCacheEngine) -> list[tuple[Any, str, tuple[Any, ...], dict[str, Any]]]:
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    return [
        (ec, "put", ("a", t), {}),
        (ec, "put", ("a", t), {}),
        (ec, "put", (3, t), {}),
        (ec, "put", ("b", "not a tensor"), {}),
        (ec, "get", ("a",), {}),
        (ec, "get", ("zz",), {}),
        (ec, "get", ("a",), {"device": "meta"}),
        (ec, "contains", ("a",), {}),
        (ec, "contains", ("zz",), {}),
        (ec, "contains", ("",), {}),
        (ec, "flush", (), {}),
        (ec, "flush", (5.0,), {}),
        (ec, "flush", (), {"timeout": 5.0}),
        (ec, "delete", ("a",), {}),
        (ec, "delete", ("a",), {}),
        (ec, "get", ("a",), {}),
    ]


def test_ec_blocking_methods_give_what_their_coroutines_give() -> None:
    made: list[ECCacheEngine] = []

    def make() -> ECCacheEngine:
        made.append(_ec())
        return made[-1]

    try:
        _both(make, _ec_script)
        stats = [{k: v for k, v in ec.stats().items() if k != "storage"} for ec in made]
        assert stats[0] == stats[1]
    finally:
        for ec in made:
            ec.close()


def test_closed_engines_raise_alike_in_both_forms(make_engine: EngineFactory) -> None:
    eng = make_engine()
    hs = eng.hidden_state_store
    assert hs is not None
    eng.close()
    toks = tokens(CHUNK)
    for obj, name, args in ((eng, "lookup", (toks,)), (eng, "retrieve", (toks,)), (hs, "coverage", (toks,))):
        with pytest.raises(Exception) as sync_err:
            getattr(obj, name)(*args)
        with pytest.raises(Exception) as async_err:
            asyncio.run(getattr(obj, "a" + name)(*args))
        assert type(sync_err.value) is type(async_err.value)
        assert str(sync_err.value) == str(async_err.value)


# ---- the blocking form stays on the caller's thread ------------------------------------------------
@pytest.fixture
def every_copy_large_and_no_executor(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every copy counts as large, and any use of the copy executor fails the test."""

    def refuse(fn: Callable[[], Any]) -> Any:
        raise AssertionError("a blocking call handed its copy to the executor")

    monkeypatch.setattr(_offload, "OFF_LOOP_COPY_BYTES", 1)
    monkeypatch.setattr(_offload, "run_off_loop", refuse)
    yield


def _refuse_loop_crossings(monkeypatch: pytest.MonkeyPatch, *managers: Any) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        for a in args:
            if asyncio.iscoroutine(a):
                a.close()
        raise AssertionError("the call crossed to a manager's loop thread")

    for sm in managers:
        for name in ("submit", "run_sync", "run_async"):
            monkeypatch.setattr(sm.loop_thread, name, refuse)


def test_blocking_forms_copy_inline_and_never_cross_for_cpu_work(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, every_copy_large_and_no_executor: None
) -> None:
    eng = make_engine()
    hs = eng.hidden_state_store
    assert hs is not None
    ec = _ec()
    try:
        _refuse_loop_crossings(monkeypatch, eng.storage_manager, hs.storage_manager, ec.storage_manager)
        threads: list[threading.Thread] = []

        def wrap(fn: Callable[..., bool]) -> Callable[..., bool]:
            def recorded(*args: Any) -> bool:
                threads.append(threading.current_thread())
                return fn(*args)

            return recorded

        for mod in (kv, hidden_states):
            monkeypatch.setattr(mod, "copy_in", wrap(_chunks.copy_in))
            monkeypatch.setattr(mod, "copy_out", wrap(_chunks.copy_out))
        toks = tokens(3 * CHUNK, seed=70)
        assert eng.store(toks, kv_for(3 * CHUNK, seed=70)) == 3
        assert hs.store_hidden_states(toks, hidden(3 * CHUNK, seed=70)) == 3
        n, got = eng.retrieve(toks)
        assert n == 3 * CHUNK and got is not None and torch.equal(got, kv_for(3 * CHUNK, seed=70))
        got_hs = hs.retrieve_hidden_states(toks)
        assert got_hs is not None and torch.equal(got_hs, hidden(3 * CHUNK, seed=70))
        assert eng.lookup(toks) == 3 * CHUNK and hs.coverage(toks) == 3 * CHUNK
        assert len(threads) == 12 and all(t is threading.current_thread() for t in threads)
        t = torch.randn(64, HIDDEN)
        assert ec.put("big", t)
        big = ec.get("big")
        assert big is not None and torch.equal(big, t)
        assert ec.contains("big") and ec.delete("big")
        ec.flush()
    finally:
        ec.close()


def test_a_blocking_method_on_the_managers_loop_thread_raises(make_engine: EngineFactory) -> None:
    eng = make_engine()
    hs = eng.hidden_state_store
    assert hs is not None
    ec = _ec()
    try:
        toks = tokens(CHUNK)

        async def on_loop(call: Callable[[], Any]) -> Any:
            return call()

        for sm, call in (
            (eng.storage_manager, lambda: eng.lookup(toks)),
            (eng.storage_manager, lambda: hs.coverage(toks)),
            (ec.storage_manager, lambda: ec.contains("x")),
        ):
            with pytest.raises(LoopThreadCallError):
                sm.loop_thread.run_sync(on_loop(call), 10)
    finally:
        ec.close()


# ---- every public coroutine gives its loop a turn -----------------------------------------------
async def _turns_while(calls: int, call: Callable[[], Any]) -> int:
    turns, done = 0, False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    before = turns
    for _ in range(calls):
        await call()
    got = turns - before
    done = True
    await task
    return got


async def test_adelete_and_the_other_cpu_answered_coroutines_yield_to_the_loop(make_engine: EngineFactory) -> None:
    eng = make_engine()
    hs = eng.hidden_state_store
    assert hs is not None
    key = eng.token_database.keys(tokens(CHUNK, seed=80))[0]
    ec = _ec()
    try:
        assert await ec.aput("img", torch.ones(4, 8))
        for call in (
            lambda: ec.adelete("img"),
            lambda: ec.aflush(),
            lambda: ec.aflush(timeout=1.0),
            lambda: hs.ahas_chunk(key),
            lambda: hs.adrop_key(key),
            lambda: hs.aclear(),
        ):
            assert await _turns_while(20, call) >= 20
    finally:
        await ec.aclose()
