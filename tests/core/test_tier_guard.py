"""The manager's boundary around a lower tier: a failing, hanging or skipped tier answers
NO_ANSWER (never raises), is counted, and feeds its circuit breaker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lmcache_async._manager.tier_guard import ENTRIES_PER_TIMEOUT, NO_ANSWER, TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import Allocate, StorageBackend


class Stub(StorageBackend):
    name = "stub"

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return None

    async def contains(self, key: CacheEngineKey) -> bool:
        return False

    async def remove(self, key: CacheEngineKey) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {"entries": 3}


def guard(timeout: float = 0.2) -> TierGuard:
    return TierGuard(Stub(), timeout, max_backoff_s=4.0)


async def test_a_call_that_works_returns_its_result_and_closes_the_circuit():
    g = guard()

    async def ok(x: int) -> int:
        return x + 1

    assert await g.call("get", ok, 1) == 2
    assert g.breaker.state == "closed" and g.errors == 0


async def test_a_call_that_raises_answers_no_answer_and_is_counted():
    g = guard()

    async def boom() -> int:
        raise OSError("disk gone")

    assert await g.call("put", boom) is NO_ANSWER
    st = g.stats()
    assert st["errors"] == 1 and st["timeouts"] == 0


async def test_a_call_that_hangs_answers_no_answer_after_its_timeout():
    g = guard(timeout=0.05)

    async def hang() -> int:
        await asyncio.sleep(10)
        return 0

    assert await g.call("get", hang) is NO_ANSWER
    assert g.timeouts == 1 and g.errors == 1


async def test_a_batch_gets_one_timeout_per_entries_per_timeout_entries():
    g = guard(timeout=0.5)

    async def slow() -> int:
        await asyncio.sleep(0.6)  # past one timeout, well within two
        return 7

    assert await g.call("put", slow, n=2 * ENTRIES_PER_TIMEOUT) == 7


async def test_an_open_circuit_skips_the_tier_without_calling_it():
    g = guard()
    calls = 0

    async def boom() -> int:
        nonlocal calls
        calls += 1
        raise OSError("down")

    for _ in range(g.breaker.threshold):
        await g.call("get", boom)
    assert g.breaker.state == "open"
    assert await g.call("get", boom) is NO_ANSWER
    assert calls == g.breaker.threshold and g.skipped == 1


async def test_cancellation_propagates():
    g = guard(timeout=5.0)

    async def hang() -> int:
        await asyncio.sleep(10)
        return 0

    task = asyncio.ensure_future(g.call("get", hang))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert g.errors == 0


def test_stats_carry_the_backend_figures_and_the_guard_counters():
    st = guard().stats()
    assert {
        "entries",
        "bytes",
        "evictions",
        "hits",
        "misses",
        "errors",
        "timeouts",
        "skipped",
        "writes",
        "write_failures",
        "circuit",
    } <= set(st)
    assert st["circuit"] == "closed" and st["entries"] == 3
