"""Tiers that answer on the caller's thread (``LocalTier``) are asked before any loop hop."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lmcache_async.cpu.tier import CPUBackend
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryObj, PoolAllocator
from lmcache_async.testing import make_key
from lmcache_async.tiers import (
    Allocate,
    BackendContext,
    LocalTier,
    PoolTier,
    StorageBackend,
    register_backend,
)


class HeapTier(StorageBackend):
    """A lower tier keeping its entries in its own heap buffers and answering reads on the
    caller's thread (what a client of a node-local cache server does over shared memory)."""

    name = "testlocal"

    def __init__(self) -> None:
        self._heap = HeapAllocator("testlocal")
        self._entries: dict[CacheEngineKey, MemoryObj] = {}
        self._lock = threading.Lock()
        self.caller_threads: set[int] = set()
        self.touched: list[CacheEngineKey] = []
        self.batches: list[int] = []

    def as_local(self) -> HeapTier:
        return self

    # caller-thread surface (LocalTier)
    def lookup(self, key: CacheEngineKey) -> MemoryObj | None:
        self.caller_threads.add(threading.get_ident())
        with self._lock:
            obj = self._entries.get(key)
            if obj is not None:
                obj.ref_count_up()
            return obj

    def lookup_many(self, keys: Sequence[CacheEngineKey], alloc: Any = None) -> list[MemoryObj | None]:
        self.batches.append(len(keys))
        return [self.lookup(k) for k in keys]

    def contains_nowait(self, key: CacheEngineKey) -> bool:
        return key in self._entries

    def prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self._entries:
            n += 1
        return n

    def present_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return [k in self._entries for k in keys]

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        self.touched.extend(keys)

    # loop surface
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        with self._lock:
            if key in self._entries:
                return True
        mine = self._heap.allocate(obj.shape, obj.dtype, obj.fmt)
        if mine is None:
            return False
        mine.tensor.copy_(obj.tensor)
        with self._lock:
            if self._entries.setdefault(key, mine) is not mine:
                mine.ref_count_down()
        return True

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        raise AssertionError("the manager asks a LocalTier on the caller's thread, not on the loop")

    async def contains(self, key: CacheEngineKey) -> bool:
        return key in self._entries

    async def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            obj = self._entries.pop(key, None)
        if obj is None:
            return False
        obj.ref_count_down()
        return True

    async def clear(self) -> None:
        with self._lock:
            objs = list(self._entries.values())
            self._entries.clear()
        for o in objs:
            o.ref_count_down()

    async def close(self) -> None:
        await self.clear()

    def stats(self) -> dict[str, Any]:
        return {"entries": len(self._entries)}


_made: list[HeapTier] = []


def _factory(ctx: BackendContext) -> HeapTier:
    tier = HeapTier()
    _made.append(tier)
    return tier


register_backend("testlocal", _factory, replace=True)


def _local_manager(make_manager, **overrides: Any):
    sm = make_manager(tier_order=["cpu", "testlocal"], **overrides)
    return sm, _made[-1]


def test_the_cpu_tier_is_a_pool_tier_and_a_heap_tier_only_a_local_one() -> None:
    cpu = CPUBackend(PoolAllocator(1 << 20))
    assert cpu.as_pool() is cpu and cpu.as_local() is cpu
    assert isinstance(cpu.as_pool(), PoolTier) and isinstance(cpu.as_local(), LocalTier)
    assert isinstance(HeapTier().as_local(), LocalTier) and HeapTier().as_pool() is None


def test_a_local_lower_tier_answers_get_on_the_callers_thread(make_manager) -> None:
    sm, tier = _local_manager(make_manager, local_cpu=False)
    key = make_key(1)
    assert sm.put_sync(key, torch.arange(8.0))
    sm.flush_sync()
    obj = sm.get_sync(key)
    assert obj is not None and torch.equal(obj.tensor, torch.arange(8.0))
    obj.ref_count_down()
    assert tier.caller_threads == {threading.get_ident()}


async def test_a_local_lower_tier_answers_awaited_get_before_any_hop(make_manager) -> None:
    sm, tier = _local_manager(make_manager, local_cpu=False)
    key = make_key(2)
    assert await sm.put(key, torch.ones(4))
    await sm.flush()
    objs = await sm.batched_get([key, make_key(3)])
    assert objs[0] is not None and objs[1] is None
    objs[0].ref_count_down()
    assert sm.loop_thread.thread_id not in tier.caller_threads


def test_lookup_local_reads_the_cpu_tier_then_each_local_tier(make_manager) -> None:
    sm, tier = _local_manager(make_manager)
    in_cpu, in_local = make_key(4), make_key(5)
    sm.put_sync(in_cpu, torch.zeros(4))
    sm.flush_sync()
    src = sm.get_sync(in_cpu)
    assert src is not None
    sm.loop_thread.submit(tier.put(in_local, src)).result(10)
    src.ref_count_down()
    for key in (in_cpu, in_local):
        obj = sm.lookup_local(key)
        assert obj is not None
        obj.ref_count_down()
    assert sm.lookup_local(make_key(6)) is None
    sm.close_sync()
    assert sm.lookup_local(in_cpu) is None


def test_a_batched_get_asks_a_local_tier_once_for_every_key_the_cpu_tier_misses(make_manager) -> None:
    sm, tier = _local_manager(make_manager)
    heap = HeapAllocator("seed")
    for i in (1, 2, 3):  # in the local tier only
        obj = heap.allocate((4,), torch.float32)
        obj.tensor.fill_(float(i))
        sm.loop_thread.submit(tier.put(make_key(i), obj)).result(10)
        obj.ref_count_down()
    assert sm.put_sync(make_key(0), torch.zeros(4))  # in the CPU tier
    sm.flush_sync()
    tier.batches.clear()
    got = sm.batched_get_sync([make_key(i) for i in range(5)])
    assert [None if o is None else float(o.tensor[0]) for o in got] == [0.0, 1.0, 2.0, 3.0, None]
    assert tier.batches == [4]  # one call for keys 1-4, none per key
    for o in got:
        if o is not None:
            o.ref_count_down()


def test_prefix_and_touch_reach_local_tiers(make_manager) -> None:
    sm, tier = _local_manager(make_manager, local_cpu=False)
    keys = [make_key(i) for i in range(3)]
    for k in keys[:2]:
        sm.put_sync(k, torch.zeros(4))
    sm.flush_sync()
    assert sm.prefix_len_sync(keys) == 2
    sm.touch(keys[:1])
    assert tier.touched == keys[:1]


def test_a_get_that_misses_every_local_tier_does_not_ask_them_on_the_loop(make_manager) -> None:
    sm, _ = _local_manager(make_manager, local_cpu=False)
    assert sm.get_sync(make_key(9)) is None  # HeapTier.get would raise on the loop


@pytest.mark.parametrize("local_cpu", [True, False])
def test_tier_names_are_registry_names(make_manager, local_cpu: bool) -> None:
    sm, _ = _local_manager(make_manager, local_cpu=local_cpu)
    assert sm.tier_names == (["cpu", "testlocal"] if local_cpu else ["testlocal"])
    assert set(sm.stats()["tiers"]) == set(sm.tier_names)
