"""``LMCacheEngine.open`` / ``ECCacheEngine.open``: engines built off the caller's event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from lmcache_async import ECCacheEngine, LMCacheEngine, LMCacheEngineConfig, LMCacheEngineMetadata

META = LMCacheEngineMetadata("open/model", kv_dtype=torch.float32)


def config() -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=0.01)


class _Recording(LMCacheEngine):
    built_on: int | None = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        type(self).built_on = threading.get_ident()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


async def test_an_engine_opened_from_a_loop_is_built_on_another_thread_and_works() -> None:
    engine = await _Recording.open(config(), META)
    try:
        assert _Recording.built_on is not None and _Recording.built_on != threading.get_ident()
        tokens = list(range(32))
        assert await engine.astore(tokens, torch.randn(2, 2, 32, 4)) == 2
        assert await engine.alookup(tokens) == 32
    finally:
        await engine.aclose()
    assert engine.closed


async def test_async_with_closes_the_engine_and_bad_arguments_raise_at_the_await() -> None:
    async with ECCacheEngine.open(config(), META, torch.float32) as ec:
        assert await ec.aput("img", torch.ones(3, 4))
        assert await ec.acontains("img")
    assert ec.closed
    with pytest.raises(TypeError, match="config"):
        await LMCacheEngine.open("not a config", META)  # type: ignore[arg-type]


async def test_a_cancelled_open_leaves_no_engine_running() -> None:
    def ours() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("lmcache")}

    before = ours()
    task = asyncio.ensure_future(LMCacheEngine.open(config(), META)._open())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):  # the build finishes on its thread, then the engine is closed on another
        extra = ours() - before
        if not extra:
            break
        await asyncio.sleep(0.02)
    assert not extra, extra


def test_release_gives_back_the_reference_a_get_handed_out() -> None:
    from lmcache_async import ChunkedTokenDatabase, StorageManager

    with StorageManager(config(), META) as sm:
        key = ChunkedTokenDatabase(16, metadata=META).keys(list(range(16)))[0]
        assert sm.put_sync(key, torch.ones(2, 2))
        first = sm.get_sync(key)
        assert first is not None
        held = first.get_ref_count()
        objs = sm.batched_get_sync([key, key])
        assert all(o is not None for o in objs) and first.get_ref_count() == held + 2
        for obj in objs:
            assert obj is not None
            obj.release()
        assert first.get_ref_count() == held
        first.release()
