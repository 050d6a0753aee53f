"""StorageManager contract (SPEC §4.3/§4.4) over the CPU tier and an in-process lower tier: the
local path and the lower tiers. Concurrency, close and buffer ownership under failures are in
test_storage_manager_concurrency.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from core._storage_manager_data import MiB, t1m
from support import membackend

from lmcache_async import MemoryFormat, Presence
from lmcache_async.testing import make_key


@pytest.fixture(autouse=True)
def _register():
    membackend.register()
    membackend.MemBackend.instances.clear()


# ---- local path ------------------------------------------------------------------------------


def test_put_get_contains_round_trip(make_manager):
    sm = make_manager()
    k = make_key(1)
    t = torch.randn(3, 4, 5).to(torch.bfloat16)
    assert sm.put_sync(k, t, fmt=MemoryFormat.EC_TD)
    assert sm.contains_sync(k)
    with sm.get_sync(k) as obj:
        assert obj.tensor.shape == (3, 4, 5) and obj.tensor.dtype == torch.bfloat16
        assert obj.fmt == MemoryFormat.EC_TD
        assert torch.equal(obj.tensor, t)
    assert sm.get_sync(make_key(2)) is None
    assert not sm.contains_sync(make_key(2))


def test_put_copies_the_tensor(make_manager):
    sm = make_manager()
    k = make_key(1)
    t = torch.ones(10)
    sm.put_sync(k, t)
    t.fill_(5)
    with sm.get_sync(k) as obj:
        assert torch.all(obj.tensor == 1)


def test_reput_of_present_key_is_noop_true(make_manager):
    sm = make_manager()
    k = make_key(1)
    assert sm.put_sync(k, torch.zeros(8))
    used = sm.pool.used_bytes
    assert sm.put_sync(k, torch.ones(8)) is True
    assert sm.pool.used_bytes == used
    with sm.get_sync(k) as obj:
        assert torch.all(obj.tensor == 0)


def test_concurrent_puts_of_one_key_store_one_copy(make_manager):
    sm = make_manager()
    k = make_key(1)
    results = []
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        results.append(sm.put_sync(k, torch.full((1024,), 7.0)))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [True] * 8
    assert sm.stats()["tiers"]["cpu"]["entries"] == 1
    assert sm.pool.used_bytes == 4096


def test_put_borrows_a_memory_obj(make_manager):
    sm = make_manager()
    obj = sm.allocate((256,), torch.float32, MemoryFormat.HS_TD)
    obj.tensor.fill_(2)
    assert sm.put_sync(make_key(1), obj)
    assert obj.get_ref_count() == 2  # caller's + the index's; no copy was made
    with sm.get_sync(make_key(1)) as got:
        assert got.data_ptr == obj.data_ptr
    obj.ref_count_down()
    assert sm.contains_sync(make_key(1))


def test_put_of_foreign_memory_obj_is_copied(make_manager):
    a = make_manager()
    b = make_manager()
    obj = a.allocate((16,), torch.float32)
    obj.tensor.fill_(3)
    assert b.put_sync(make_key(1), obj)
    assert obj.get_ref_count() == 1
    with b.get_sync(make_key(1)) as got:
        assert got.data_ptr != obj.data_ptr and torch.all(got.tensor == 3)
    obj.ref_count_down()


def test_put_returns_false_at_once_when_everything_is_held(make_manager):
    sm = make_manager(max_local_cpu_size=4 / 1024)  # 4 MiB
    held = []
    for i in range(4):
        assert sm.put_sync(make_key(i), t1m(i))
        held.append(sm.get_sync(make_key(i)))
    t0 = time.perf_counter()
    assert sm.put_sync(make_key(99), t1m(99)) is False
    assert time.perf_counter() - t0 < 1.0
    assert sm.stats()["put_rejected"] == 1
    held[0].ref_count_down()
    assert sm.put_sync(make_key(99), t1m(99)) is True  # the released entry was evicted
    assert not sm.contains_sync(make_key(0))
    for h in held[1:]:
        h.ref_count_down()


def test_entry_larger_than_pool_is_rejected(make_manager):
    sm = make_manager(max_local_cpu_size=1 / 1024)
    assert sm.put_sync(make_key(1), torch.zeros(2 * MiB // 4)) is False


def test_lru_eviction_keeps_recent_entries(make_manager):
    sm = make_manager(max_local_cpu_size=4 / 1024)
    for i in range(4):
        sm.put_sync(make_key(i), t1m(i))
    sm.get_sync(make_key(0)).ref_count_down()
    sm.put_sync(make_key(4), t1m(4))
    assert sm.contains_sync(make_key(0)) and not sm.contains_sync(make_key(1))
    assert sm.stats()["tiers"]["cpu"]["evictions"] == 1


def test_batched_ops(make_manager):
    sm = make_manager()
    keys = [make_key(i) for i in range(6)]
    assert sm.batched_put_sync(keys[:4], [torch.full((4,), float(i)) for i in range(4)]) == [True] * 4
    got = sm.batched_get_sync(keys)
    assert [g is not None for g in got] == [True] * 4 + [False] * 2
    for i, g in enumerate(got[:4]):
        assert torch.all(g.tensor == i)
        g.ref_count_down()
    assert sm.prefix_len_sync(keys) == 4
    assert sm.prefix_len_sync([keys[0], keys[5], keys[1]]) == 1
    assert sm.prefix_len_sync([]) == 0


def test_remove_and_clear_return_pool_to_zero(make_manager):
    sm = make_manager()
    for i in range(10):
        sm.put_sync(make_key(i), torch.zeros(1000))
    assert sm.remove_sync(make_key(0)) is True
    assert sm.remove_sync(make_key(0)) is False
    assert not sm.contains_sync(make_key(0))
    sm.clear_sync()
    assert sm.pool.used_bytes == 0
    assert sm.stats()["tiers"]["cpu"]["entries"] == 0


def test_reader_keeps_data_after_remove(make_manager):
    sm = make_manager()
    sm.put_sync(make_key(1), torch.full((64,), 9.0))
    obj = sm.get_sync(make_key(1))
    sm.remove_sync(make_key(1))
    assert torch.all(obj.tensor == 9.0)
    obj.ref_count_down()
    assert sm.pool.used_bytes == 0


def test_stats_reports_every_tier_field(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"])
    sm.put_sync(make_key(1), torch.zeros(4))
    sm.get_sync(make_key(1)).ref_count_down()
    sm.get_sync(make_key(2))
    st = sm.stats()
    for tier in ("cpu", "testmem"):
        for field in ("entries", "bytes", "hits", "misses", "evictions", "errors"):
            assert field in st["tiers"][tier], (tier, field)
    assert st["tiers"]["cpu"]["hits"] == 1 and st["tiers"]["cpu"]["misses"] == 1
    assert st["tiers"]["testmem"]["misses"] == 1


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda sm: sm.put_sync("not-a-key", torch.zeros(1)), TypeError),
        (lambda sm: sm.put_sync(make_key(1), [1, 2, 3]), TypeError),
        (lambda sm: sm.put_sync(make_key(1), torch.zeros(1), fmt=3), TypeError),
        (lambda sm: sm.get_sync(b"key"), TypeError),
        (lambda sm: sm.contains_sync(None), TypeError),
        (lambda sm: sm.prefix_len_sync([make_key(1), 5]), TypeError),
        (lambda sm: sm.batched_put_sync([make_key(1)], []), ValueError),
    ],
)
def test_caller_mistakes_raise(make_manager, call, exc):
    with pytest.raises(exc):
        call(make_manager())


# ---- lower tiers -------------------------------------------------------------------------------


def test_write_through_and_flush(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"])
    lower = membackend.last()
    lower.delay = 0.05
    for i in range(5):
        sm.put_sync(make_key(i), torch.full((16,), float(i)))
    assert sm.contains_sync(make_key(4))  # read-your-writes while in flight
    sm.flush_sync()
    assert len(lower.data) == 5
    assert sm.stats()["pending_writes"] == 0


def test_evicted_entry_is_served_from_lower_tier_and_promoted(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=1 / 1024)  # holds one 1 MiB entry
    a, b = t1m(1), t1m(2)
    sm.put_sync(make_key(1), a)
    sm.flush_sync()
    sm.put_sync(make_key(2), b)
    sm.flush_sync()
    assert not sm.backend("cpu").contains_nowait(make_key(1))
    assert sm.contains_sync(make_key(1))
    with sm.get_sync(make_key(1)) as obj:
        assert torch.equal(obj.tensor, a)
    assert sm.backend("cpu").contains_nowait(make_key(1))  # promoted
    assert sm.stats()["tiers"]["testmem"]["hits"] == 1


def test_full_cpu_tier_serves_lower_hits_from_staging(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=1 / 1024)
    sm.put_sync(make_key(1), t1m(1))
    sm.flush_sync()
    sm.put_sync(make_key(2), t1m(2))
    held = sm.get_sync(make_key(2))  # CPU now full of a held entry
    with sm.get_sync(make_key(1)) as obj:
        assert obj.allocator is not sm.pool
        assert torch.equal(obj.tensor, t1m(1))
    held.ref_count_down()
    assert sm.staging_pool.used_bytes == 0


def test_lower_tier_without_cpu_tier_has_read_your_writes(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], local_cpu=False)
    lower = membackend.last()
    lower.delay = 0.1
    sm.put_sync(make_key(1), torch.full((8,), 4.0))
    assert sm.contains_sync(make_key(1))
    with sm.get_sync(make_key(1)) as obj:
        assert torch.all(obj.tensor == 4.0)
    sm.flush_sync()
    assert make_key(1) in lower.data
    with sm.get_sync(make_key(1)) as obj:
        assert torch.all(obj.tensor == 4.0)


def test_a_tier_order_without_cpu_allocates_no_cpu_pool(make_manager):
    sm = make_manager(tier_order=["testmem"])  # local_cpu is on by default
    assert sm.pool is None and sm.tier_names == ["testmem"]
    assert sm.allocate((8,), torch.float32) is None  # no CPU tier: no pool block to hand out
    assert sm.put_sync(make_key(1), torch.full((8,), 2.0))
    sm.flush_sync()
    with sm.get_sync(make_key(1)) as obj:
        assert torch.all(obj.tensor == 2.0)


def test_batched_get_falls_through_per_key(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=2 / 1024)
    keys = [make_key(i) for i in range(4)]
    for i, k in enumerate(keys):
        assert sm.put_sync(k, t1m(i))
        sm.flush_sync()  # entries waiting for write-through are not evictable
    got = sm.batched_get_sync(keys + [make_key(99)])
    assert [g is not None for g in got] == [True] * 4 + [False]
    for i, g in enumerate(got[:4]):
        assert torch.equal(g.tensor, t1m(i))
        g.ref_count_down()
    assert sm.prefix_len_sync(keys + [make_key(99)]) == 4


def test_remove_reaches_lower_tiers_even_while_writing(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"])
    lower = membackend.last()
    lower.delay = 0.1
    sm.put_sync(make_key(1), torch.zeros(4))
    assert sm.remove_sync(make_key(1)) is True
    sm.flush_sync()
    assert make_key(1) not in lower.data
    assert not sm.contains_sync(make_key(1))


def test_failing_tier_is_a_miss_counted_and_skipped(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], local_cpu=False, remote_timeout_s=0.5)
    lower = membackend.last()
    lower.mode = "fail"
    assert sm.get_sync(make_key(1)) is None
    assert sm.contains_sync(make_key(1)) is False
    assert sm.presence_sync(make_key(1)) is Presence.UNKNOWN
    for _ in range(5):
        sm.get_sync(make_key(1))
    st = sm.stats()["tiers"]["testremote"]
    assert st["errors"] >= 3 and st["skipped"] >= 1 and st["circuit"] == "open"


def test_hanging_tier_returns_within_its_timeout(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], remote_timeout_s=0.3, blocking_timeout_secs=5)
    membackend.last().mode = "hang"
    t0 = time.perf_counter()
    assert sm.get_sync(make_key(1)) is None
    assert time.perf_counter() - t0 < 2 * 0.3 + 0.5
    assert sm.stats()["tiers"]["testremote"]["timeouts"] == 1


def test_tier_recovers_after_failures(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], remote_timeout_s=0.3)
    lower = membackend.last()
    tier = sm._lower[0]
    now = [0.0]
    tier.breaker.clock = lambda: now[0]  # an injected clock instead of a sleep past the back-off
    tier.breaker.base_backoff_s = tier.breaker._backoff = 0.05
    lower.mode = "fail"
    for _ in range(4):
        sm.get_sync(make_key(1))
    assert tier.breaker.state == "open"
    lower.mode = "ok"
    lower.data[make_key(1)] = ((2,), torch.float32, MemoryFormat.UNDEFINED, torch.ones(2).numpy().tobytes())
    assert sm.get_sync(make_key(1)) is None  # still inside the back-off: the tier is skipped
    now[0] += 0.1
    with sm.get_sync(make_key(1)) as obj:
        assert torch.all(obj.tensor == 1)
    assert tier.breaker.state == "closed"


def test_sync_call_times_out_with_timeout_error(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], remote_timeout_s=5, blocking_timeout_secs=0.3)
    membackend.last().mode = "hang"
    with pytest.raises(TimeoutError):
        sm.get_sync(make_key(1))
