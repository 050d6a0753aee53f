"""Engine coroutines answered by the CPU tier still give their event loop a turn, so one task
calling them in a loop cannot starve the loop's other tasks (counted, not timed)."""

from __future__ import annotations

import asyncio

import torch

from lmcache_async import ECCacheEngine, LMCacheEngine, LMCacheEngineConfig, LMCacheEngineMetadata


async def _interleaved(busy_calls: int, call: object) -> int:
    """How many turns a second task got while one task awaited ``call()`` ``busy_calls`` times."""
    turns = 0
    done = False

    async def other() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)  # let it start
    before = turns
    for _ in range(busy_calls):
        await call()  # type: ignore[operator]
    got = turns - before
    done = True
    await task
    return got


async def test_cpu_answered_ec_coroutines_let_other_tasks_run() -> None:
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=16 / 1024)
    with ECCacheEngine(cfg, LMCacheEngineMetadata("fair-ec"), torch.bfloat16) as ec:
        assert await ec.aput("img", torch.ones(4, 8, dtype=torch.bfloat16))

        async def get() -> None:
            t = await ec.aget("img")
            assert t is not None

        assert await _interleaved(50, lambda: ec.acontains("img")) >= 50
        assert await _interleaved(50, get) >= 50


async def test_cpu_answered_kv_coroutines_let_other_tasks_run() -> None:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, max_local_cpu_size=16 / 1024)
    with LMCacheEngine(cfg, LMCacheEngineMetadata("fair-kv")) as kv:
        tokens = list(range(32))
        await kv.astore(tokens, torch.randn(2, 2, 32, 8))
        assert await _interleaved(50, lambda: kv.alookup(tokens)) >= 50
