"""The kit's eviction check, checked: it passes a tier that keeps its word (also when the reports
come late, from another thread) and fails, naming the key and what is wrong, a tier that
declares ``reports_removals`` and then evicts without reporting, reports what it still holds,
reports one eviction twice, reports under another name, or ignores its budget."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.testing.eviction_conformance import KEY_BASE, EvictionConformanceTests, eviction_problems
from lmcache_async.testing.objects import make_key
from lmcache_async.tiers import Allocate, BackendContext, RemovalReason, StorageBackend

CAP = 64 << 10  # entries of 4 KiB: 16 fit


class _FifoTier(StorageBackend):
    """Byte copies, the oldest evicted to make room: truthful unless ``lie`` says how not."""

    name = "fifo"

    def __init__(self, ctx: BackendContext, capacity: int, lie: str = "", declares: bool = True) -> None:
        self._alloc = ctx.staging
        self._cap = capacity
        self._lie = lie
        self._declares = declares
        self._lock = threading.Lock()
        self._records: dict[CacheEngineKey, tuple[tuple[int, ...], Any, Any, bytes]] = {}
        self._bytes = 0
        self.late: list[threading.Timer] = []

    @property
    def reports_removals(self) -> bool:
        return self._declares

    def _evicted(self, keys: list[CacheEngineKey], newest: CacheEngineKey) -> None:
        if not keys or self._lie == "silent":
            return
        if self._lie == "holds":  # names the entry it just stored instead of the one it dropped
            keys = [newest]
        if self._lie == "twice":
            self.report_removed(keys, RemovalReason.EVICTED)
        if self._lie == "misnamed":
            listener = getattr(self, "_removal_listener", None)
            if listener is not None:
                listener("not-" + self.name, list(keys), RemovalReason.EVICTED)
            return
        if self._lie == "late":  # truthful, but from another thread a while later
            t = threading.Timer(0.2, self.report_removed, (keys, RemovalReason.EVICTED))
            self.late.append(t)
            t.start()
            return
        self.report_removed(keys, RemovalReason.EVICTED)

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        record = (tuple(obj.shape), obj.dtype, obj.fmt, bytes(obj.byte_view()))
        size = len(record[3])
        if size > self._cap:
            return False
        evicted: list[CacheEngineKey] = []
        with self._lock:
            if key in self._records:
                return True
            while self._lie != "unbounded" and self._bytes + size > self._cap:
                old = next(iter(self._records))
                self._bytes -= len(self._records.pop(old)[3])
                evicted.append(old)
            self._records[key] = record
            self._bytes += size
        self._evicted(evicted, key)
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        with self._lock:
            record = self._records.get(key)
        if record is None:
            return None
        obj = (alloc or self._alloc)(record[0], record[1], record[2])
        assert obj is not None
        obj.byte_view()[:] = record[3]
        return obj

    async def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._records

    async def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self._bytes -= len(record[3])
        if record is not None:
            self.report_removed([key], RemovalReason.DELETED)
        return record is not None

    async def close(self) -> None:
        for t in self.late:
            t.cancel()


@pytest.fixture
def pool() -> PoolAllocator:
    return PoolAllocator(8 << 20, name="kit-evictions-src", pretouch=False)


async def _problems(backend_context: Any, pool: PoolAllocator, lie: str = "") -> list[str]:
    tier = _FifoTier(backend_context(), CAP, lie)
    try:
        return await eviction_problems(tier, pool, CAP, wait_s=1.0)
    finally:
        await tier.close()


async def test_a_truthful_tier_passes(backend_context: Any, pool: PoolAllocator) -> None:
    assert await _problems(backend_context, pool) == []


async def test_late_reports_from_another_thread_are_waited_for(backend_context: Any, pool: PoolAllocator) -> None:
    assert await _problems(backend_context, pool, "late") == []


async def test_a_tier_that_evicts_without_reporting_fails_naming_the_key_and_the_reason(
    backend_context: Any, pool: PoolAllocator
) -> None:
    problems = await _problems(backend_context, pool, "silent")
    assert problems
    first = problems[0]
    assert "tier 'fifo' no longer holds key" in first and "never reported" in first and "EVICTED missing" in first
    assert str(make_key(KEY_BASE)) in first  # the first key put is the first pushed out, and named


async def test_a_report_of_a_key_still_held_fails(backend_context: Any, pool: PoolAllocator) -> None:
    problems = await _problems(backend_context, pool, "holds")
    assert any("reported key" in p and "as EVICTED but still holds it" in p for p in problems), problems


async def test_one_eviction_reported_twice_fails(backend_context: Any, pool: PoolAllocator) -> None:
    problems = await _problems(backend_context, pool, "twice")
    assert any("as EVICTED twice without it being put again" in p for p in problems), problems


async def test_a_report_under_another_name_fails(backend_context: Any, pool: PoolAllocator) -> None:
    problems = await _problems(backend_context, pool, "misnamed")
    assert any("names tier 'not-fifo', not the tier's name 'fifo'" in p for p in problems), problems


async def test_a_tier_that_ignores_its_budget_fails(backend_context: Any, pool: PoolAllocator) -> None:
    problems = await _problems(backend_context, pool, "unbounded")
    assert len(problems) == 1 and "evicted nothing" in problems[0], problems


class _Kit(EvictionConformanceTests):
    """The kit's own test method, run on a hand-made tier (not collected: no ``Test`` prefix)."""

    bounded_capacity_bytes = CAP
    eviction_report_wait_s = 1.0

    def __init__(self, lie: str | None, declares: bool = True) -> None:
        self.lie = lie
        self.declares = declares

    async def make_backend(self, ctx: BackendContext, location: Path) -> StorageBackend:
        return _FifoTier(ctx, 1 << 30)

    async def make_bounded_backend(
        self, ctx: BackendContext, location: Path, capacity_bytes: int
    ) -> StorageBackend | None:
        if self.lie is None:
            return None
        return _FifoTier(ctx, capacity_bytes, self.lie, self.declares)


async def test_the_kit_test_fails_a_tier_that_lies(backend_context: Any, pool: PoolAllocator, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"(?s)no longer holds key .*EVICTED missing"):
        await _Kit("silent").test_what_it_evicts_it_reports_and_holds_no_more(backend_context, tmp_path, pool)
    await _Kit("").test_what_it_evicts_it_reports_and_holds_no_more(backend_context, tmp_path, pool)


@pytest.mark.parametrize(
    ("kit", "reason"),
    [
        (_Kit(None), "does not implement make_bounded_backend"),
        (_Kit("silent", declares=False), "does not declare reports_removals"),
    ],
)
async def test_the_kit_test_skips_saying_why(
    backend_context: Any, pool: PoolAllocator, tmp_path: Path, kit: _Kit, reason: str
) -> None:
    with pytest.raises(pytest.skip.Exception, match=reason):
        await kit.test_what_it_evicts_it_reports_and_holds_no_more(backend_context, tmp_path, pool)
