"""The CPU tier's eviction runs on the shared LRU index (:class:`lmcache_async.lru.LruIndex`):
held entries (a reader, an in-flight write-through, a protected key) are passed over, never
evicted, and keep their place in the order."""

from __future__ import annotations

import torch

from lmcache_async.cpu.tier import CPUBackend
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.testing import make_key

BLOCK = 4096  # 1024 float32


def _tier(blocks: int, policy: str = "LRU") -> CPUBackend:
    return CPUBackend(PoolAllocator(blocks * BLOCK, name="cpu-lru", pretouch=False), policy)


def _put(cpu: CPUBackend, key: CacheEngineKey, value: float = 1.0, extra_refs: int = 0) -> MemoryObj:
    obj = cpu.allocate((1024,), torch.float32)
    assert obj is not None
    obj.tensor.fill_(value)
    assert cpu.insert(key, obj, extra_refs=extra_refs) is None
    return obj


def _present(cpu: CPUBackend, n: int) -> list[int]:
    return [i for i in range(n) if cpu.contains_nowait(make_key(i))]


def test_a_reader_holds_the_oldest_entry_and_the_next_oldest_goes_instead() -> None:
    cpu = _tier(3, "FIFO")  # a read does not move the entry: it stays the oldest
    for i in range(3):
        _put(cpu, make_key(i), float(i))
    reader = cpu.lookup(make_key(0))
    assert reader is not None
    _put(cpu, make_key(3))
    assert _present(cpu, 4) == [0, 2, 3] and cpu.evictions == 1
    assert torch.all(reader.tensor == 0.0)
    reader.ref_count_down()
    _put(cpu, make_key(4))  # released, it is the oldest again: it goes first
    assert _present(cpu, 5) == [2, 3, 4]


def test_an_in_flight_write_through_holds_its_entry_until_it_lets_go() -> None:
    cpu = _tier(2)
    writing = _put(cpu, make_key(0), extra_refs=1)  # the write-through's reference
    _put(cpu, make_key(1))
    _put(cpu, make_key(2))
    assert _present(cpu, 3) == [0, 2]
    writing.ref_count_down()
    _put(cpu, make_key(3))
    assert _present(cpu, 4) == [2, 3]


def test_protected_keys_are_held_for_one_allocation() -> None:
    cpu = _tier(2)
    _put(cpu, make_key(0))
    _put(cpu, make_key(1))
    obj = cpu.allocate((1024,), torch.float32, protect={make_key(0)})
    assert obj is not None and _present(cpu, 2) == [0]
    obj.ref_count_down()


def test_when_every_entry_is_held_nothing_is_evicted_and_nothing_is_handed_out() -> None:
    cpu = _tier(2)
    a, b = _put(cpu, make_key(0)), _put(cpu, make_key(1))
    a.ref_count_up()
    b.ref_count_up()
    assert cpu.allocate((1024,), torch.float32) is None
    assert _present(cpu, 2) == [0, 1] and cpu.evictions == 0 and cpu.bytes == 2 * BLOCK
    a.ref_count_down()
    b.ref_count_down()


def test_bytes_follow_every_removal_path() -> None:
    cpu = _tier(4)
    for i in range(4):
        _put(cpu, make_key(i))
    assert cpu.bytes == 4 * BLOCK == cpu.stats()["bytes"]
    _put(cpu, make_key(4))  # eviction
    assert cpu.bytes == 4 * BLOCK
    assert cpu.remove_nowait(make_key(4)) and cpu.bytes == 3 * BLOCK
    assert not cpu.remove_nowait(make_key(4)) and cpu.bytes == 3 * BLOCK
    cpu.clear_nowait()
    assert cpu.bytes == 0 and len(cpu) == 0 and cpu.pool.used_bytes == 0


def test_lookup_touches_under_lru_and_not_under_fifo() -> None:
    for policy, survivor in (("LRU", 0), ("FIFO", 1)):
        cpu = _tier(2, policy)
        _put(cpu, make_key(0))
        _put(cpu, make_key(1))
        got = cpu.lookup(make_key(0))
        assert got is not None
        got.ref_count_down()
        _put(cpu, make_key(2))
        assert _present(cpu, 3) == [survivor, 2], policy
        assert cpu.keys_snapshot() == [make_key(survivor), make_key(2)]


def test_lock_free_presence_sees_inserts_and_removals() -> None:
    cpu = _tier(2)
    key = make_key(7)
    assert not cpu.contains_nowait(key) and key not in cpu
    _put(cpu, key)
    assert cpu.contains_nowait(key) and key in cpu and cpu.present_flags([key, make_key(8)]) == [True, False]
    cpu.remove_nowait(key)
    assert not cpu.contains_nowait(key) and cpu.prefix_len([key]) == 0
