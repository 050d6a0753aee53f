"""The CPU tier passes the conformance suite and keeps its own rules (LRU, held entries)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmcache_async.cpu.tier import CPUBackend
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.testing import BackendConformanceTests, make_key
from lmcache_async.tiers import BackendContext


class TestCPUConformance(BackendConformanceTests):
    async def make_backend(self, ctx: BackendContext, location: Path) -> CPUBackend:
        return CPUBackend(PoolAllocator(64 << 20, name="cpu-under-test", pretouch=False))

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> CPUBackend:
        return CPUBackend(PoolAllocator(capacity_bytes, name="cpu-bounded", pretouch=False))


def _fill(cpu: CPUBackend, key, n: int = 1024):
    obj = cpu.allocate((n,), torch.float32, MemoryFormat.UNDEFINED)
    assert obj is not None
    obj.tensor.fill_(1.0)
    assert cpu.insert(key, obj) is None
    return obj


def test_lru_evicts_least_recently_used_first():
    pool = PoolAllocator(4 * 4096, name="t", pretouch=False, align=256)
    cpu = CPUBackend(pool, "LRU")
    keys = [make_key(i) for i in range(4)]
    for k in keys:
        _fill(cpu, k)
    got = cpu.lookup(keys[0])  # touch key 0
    assert got is not None
    got.ref_count_down()
    _fill(cpu, make_key(99))
    assert cpu.contains_nowait(keys[0])
    assert not cpu.contains_nowait(keys[1])
    assert cpu.evictions == 1


def test_fifo_ignores_touches():
    pool = PoolAllocator(4 * 4096, name="t", pretouch=False)
    cpu = CPUBackend(pool, "FIFO")
    keys = [make_key(i) for i in range(4)]
    for k in keys:
        _fill(cpu, k)
    got = cpu.lookup(keys[0])
    assert got is not None
    got.ref_count_down()
    _fill(cpu, make_key(99))
    assert not cpu.contains_nowait(keys[0])


def test_entry_held_by_reader_is_never_evicted():
    pool = PoolAllocator(2 * 4096, name="t", pretouch=False)
    cpu = CPUBackend(pool)
    a, b = make_key(1), make_key(2)
    _fill(cpu, a)
    _fill(cpu, b)
    held = cpu.lookup(a)
    held2 = cpu.lookup(b)
    assert held is not None and held2 is not None
    assert cpu.allocate((1024,), torch.float32) is None  # both held: nothing evictable
    held2.ref_count_down()
    obj = cpu.allocate((1024,), torch.float32)
    assert obj is not None
    assert cpu.contains_nowait(a) and not cpu.contains_nowait(b)
    assert torch.all(held.tensor == 1.0)
    obj.ref_count_down()
    held.ref_count_down()


def test_clear_returns_pool_to_zero():
    pool = PoolAllocator(1 << 20, name="t", pretouch=False)
    cpu = CPUBackend(pool)
    for i in range(10):
        _fill(cpu, make_key(i), 256)
    cpu.clear_nowait()
    assert pool.used_bytes == 0
    assert cpu.bytes == 0


def test_allocate_checks_its_arguments_whether_or_not_the_pool_has_room():
    pool = PoolAllocator(4 * 4096, name="t", pretouch=False, align=256)
    cpu = CPUBackend(pool, "LRU")
    for key in range(4):
        _fill(cpu, make_key(key))  # the pool is full
    for _ in range(2):
        with pytest.raises(TypeError, match="dtype"):
            cpu.allocate((4,), "float32")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="negative"):
            cpu.allocate((-1, 4), torch.float32)
        with pytest.raises(TypeError, match="ints"):
            cpu.allocate((2.5,), torch.float32)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="tuple of ints"):
            cpu.allocate("abc", torch.float32)  # type: ignore[arg-type]
        cpu.clear_nowait()


def test_allocate_into_a_full_pool_evicts_only_what_it_needs():
    pool = PoolAllocator(4 * 4096, name="t", pretouch=False, align=256)
    cpu = CPUBackend(pool, "LRU")
    keys = [make_key(i) for i in range(4)]
    for k in keys:
        _fill(cpu, k)
    assert pool.free_bytes == 0
    assert cpu.allocate((1024,), torch.float32, evict=False) is None  # no room, nothing evicted
    assert cpu.evictions == 0 and len(cpu) == 4
    obj = cpu.allocate((512,), torch.float32)  # half a block: the oldest entry goes
    assert obj is not None
    assert cpu.evictions == 1
    assert not cpu.contains_nowait(keys[0]) and all(cpu.contains_nowait(k) for k in keys[1:])
    again = cpu.allocate((512,), torch.float32)  # fits in what that eviction freed
    assert again is not None
    assert cpu.evictions == 1
    obj.ref_count_down()
    again.ref_count_down()
    assert cpu.allocate((64 * 1024,), torch.float32) is None  # can never fit: nothing evicted
    assert cpu.evictions == 1


def test_an_entry_released_once_too_often_is_dropped_as_a_miss_never_served(make_manager) -> None:
    """References are counted, not named: a caller's second release gives back the CPU tier's own
    reference and frees the block. The tier must then neither serve the freed block (another
    key's bytes once the pool reuses it) nor raise on its next lookup, eviction or close."""
    sm = make_manager(tier_order=["cpu"])
    a, b = make_key(1), make_key(2)
    assert sm.put_sync(a, torch.full((256,), 1.0))
    obj = sm.get_sync(a)
    assert obj is not None
    obj.release()
    obj.release()  # the caller's mistake: the tier's reference goes with it
    assert sm.put_sync(b, torch.full((256,), 2.0))  # may reuse a's freed block
    assert sm.get_sync(a) is None  # a counted miss, not b's bytes and not an exception
    got = sm.get_sync(b)
    assert got is not None and bool((got.tensor == 2.0).all())
    got.release()
    assert sm.backend("cpu").stats()["over_released"] == 1
    assert not sm.contains_sync(a)
    sm.close_sync()  # no DoubleReleaseError from the tier's close


def test_an_over_released_entry_is_evictable_and_its_eviction_does_not_raise() -> None:
    pool = PoolAllocator(2 * 4096, name="t-over", pretouch=False, align=256)
    cpu = CPUBackend(pool, "LRU")
    obj = _fill(cpu, make_key(1))
    obj.ref_count_down()  # the index's reference, given back by someone else
    for i in range(2, 6):  # fills past the pool: the freed entry is taken out of the index
        _fill(cpu, make_key(i))
    assert make_key(1) not in cpu
    assert obj.get_ref_count() == 0
