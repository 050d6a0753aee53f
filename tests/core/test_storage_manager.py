"""StorageManager contract (SPEC §4.3/§4.4) over the CPU tier and an in-process lower tier."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time

import pytest
import torch
from support import membackend

from lmcache_async import (
    ForkedProcessError,
    LoopThreadCallError,
    ManagerClosedError,
    MemoryFormat,
    Presence,
    StorageManager,
)
from lmcache_async.testing import make_key

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _register():
    membackend.register()
    membackend.MemBackend.instances.clear()


def t1m(seed: int = 0) -> torch.Tensor:
    return torch.randn(MiB // 4, generator=torch.Generator().manual_seed(seed))


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


# ---- async surface -----------------------------------------------------------------------------


async def test_awaitable_from_a_foreign_loop(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=1 / 1024)
    assert await sm.put(make_key(1), t1m(1))
    await sm.flush()
    assert await sm.put(make_key(2), t1m(2))
    assert await sm.contains(make_key(1))
    obj = await sm.get(make_key(1))  # served by the lower tier through the bridge
    assert torch.equal(obj.tensor, t1m(1))
    obj.ref_count_down()
    got = await sm.batched_get([make_key(1), make_key(3)])
    assert got[1] is None
    got[0].ref_count_down()
    assert await sm.prefix_len([make_key(1), make_key(2), make_key(3)]) == 2
    assert await sm.remove(make_key(2))
    await sm.clear()
    assert not await sm.contains(make_key(1))


async def test_async_with_closes(small_config, metadata):
    async with StorageManager(small_config(), metadata) as sm:
        await sm.put(make_key(1), torch.zeros(2))
    assert sm.closed
    with pytest.raises(ManagerClosedError):
        await sm.get(make_key(1))


async def test_cancelled_foreign_get_does_not_leak(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], local_cpu=False)
    lower = membackend.last()
    sm.put_sync(make_key(1), torch.zeros(1024))
    sm.flush_sync()
    lower.delay = 0.2
    task = asyncio.ensure_future(sm.get(make_key(1)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.4)
    assert sm.staging_pool.used_bytes == 0


def test_sync_calls_on_the_loop_thread_raise(make_manager):
    sm = make_manager()

    async def inner():
        errors = []
        for call in (
            lambda: sm.get_sync(make_key(1)),
            lambda: sm.put_sync(make_key(1), torch.zeros(1)),
            lambda: sm.contains_sync(make_key(1)),
            lambda: sm.flush_sync(),
            lambda: sm.close_sync(),
        ):
            try:
                call()
            except LoopThreadCallError:
                errors.append(True)
        return errors

    assert sm.loop_thread.run_sync(inner(), timeout=5) == [True] * 5


def test_calls_after_close_raise(make_manager):
    sm = make_manager()
    sm.put_sync(make_key(1), torch.zeros(1))
    sm.close_sync()
    sm.close_sync()  # idempotent
    for call in (
        lambda: sm.put_sync(make_key(1), torch.zeros(1)),
        lambda: sm.get_sync(make_key(1)),
        lambda: sm.contains_sync(make_key(1)),
        lambda: sm.prefix_len_sync([make_key(1)]),
        lambda: sm.remove_sync(make_key(1)),
    ):
        with pytest.raises(ManagerClosedError):
            call()


def test_close_with_held_references_warns_and_keeps_data(make_manager, caplog):
    sm = make_manager()
    pool = sm.pool
    sm.put_sync(make_key(1), torch.full((8,), 6.0))
    obj = sm.get_sync(make_key(1))
    with caplog.at_level(logging.WARNING, logger="lmcache_async.storage_manager"):
        sm.close_sync()
    assert "hold" in caplog.text
    assert sm.pool is None  # the manager lets go of its pool at close
    assert torch.all(obj.tensor == 6.0)
    obj.ref_count_down()
    assert pool.used_bytes == 0


def test_close_flushes_pending_writes(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"])
    lower = membackend.last()
    lower.delay = 0.05
    for i in range(4):
        sm.put_sync(make_key(i), torch.zeros(4))
    sm.close_sync()
    assert len(lower.data) == 4 and lower.closed


def test_every_thread_is_a_named_daemon(make_manager):
    before = set(threading.enumerate())
    sm = make_manager(tier_order=["cpu", "testmem"])
    sm.put_sync(make_key(1), torch.zeros(4))
    sm.flush_sync()
    new = [t for t in threading.enumerate() if t not in before]
    assert new
    for t in new:
        assert t.daemon and t.name.startswith("lmcache-async"), t.name


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_gets_a_clear_error(make_manager):
    sm = make_manager()
    sm.put_sync(make_key(1), torch.zeros(4))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = b"?"
        try:
            sm.contains_sync(make_key(1))
            out = b"no-error"
        except ForkedProcessError:
            out = b"ok"
        except BaseException as exc:  # pragma: no cover
            out = type(exc).__name__.encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 64) == b"ok"
    os.close(r)
    assert sm.contains_sync(make_key(1))


def test_many_threads_stay_consistent(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=8 / 1024)
    errors = []

    def worker(w):
        try:
            for i in range(50):
                k = make_key(w * 1000 + i)
                t = torch.full((4096,), float(w * 1000 + i))
                assert sm.put_sync(k, t)
                obj = sm.get_sync(k)
                if obj is not None:
                    assert torch.all(obj.tensor == float(w * 1000 + i))
                    obj.ref_count_down()
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    sm.flush_sync()
    sm.clear_sync()
    gc.collect()
    assert sm.pool.used_bytes == 0


def test_cpu_full_of_pending_writes_stages_new_puts(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=2 / 1024, staging_size=4 / 1024)
    lower = membackend.last()
    lower.delay = 0.3  # write-through lags: CPU entries stay pinned by their pending writes
    for i in range(4):
        assert sm.put_sync(make_key(i), t1m(i)), i  # 2 in CPU, 2 staged
    for i in range(4):
        with sm.get_sync(make_key(i)) as obj:  # read-your-writes for staged entries too
            assert torch.equal(obj.tensor, t1m(i))
    for i in range(4, 8):
        sm.put_sync(make_key(i), t1m(i))  # staging (4 MiB) fills: some of these may be refused
    sm.flush_sync()
    assert all(make_key(i) in lower.data for i in range(4))
    assert sm.staging_pool.used_bytes == 0


# ---- ownership under failures and cancellation -------------------------------------------------


def _fill_lower(sm, lower, keys):
    for i, k in enumerate(keys):
        lower.data[k] = ((256,), torch.float32, MemoryFormat.UNDEFINED, torch.full((256,), float(i)).numpy().tobytes())


def test_batched_get_cancelled_in_a_later_tier_releases_earlier_hits(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem", "testremote"], remote_timeout_s=5, blocking_timeout_secs=0.5)
    first, second = membackend.all_named(["testmem", "testremote"])
    keys = [make_key(i) for i in range(2)]
    _fill_lower(sm, first, keys[:1])  # key 0 in the first lower tier; key 1 nowhere
    second.mode = "hang"
    pool = sm.pool
    with pytest.raises(TimeoutError):
        sm.batched_get_sync(keys)
    time.sleep(0.2)
    with pytest.raises(TimeoutError):  # the hung tier's clear outlasts blocking_timeout_secs
        sm.clear_sync()  # the CPU tier is cleared before the hop
    assert pool.used_bytes == 0 and sm.staging_pool.used_bytes == 0


def test_batched_get_releases_cpu_hits_when_the_lower_tier_times_out(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], remote_timeout_s=5, blocking_timeout_secs=0.3)
    sm.put_sync(make_key(0), torch.zeros(8))
    sm.flush_sync()
    membackend.last().mode = "hang"
    with pytest.raises(TimeoutError):
        sm.batched_get_sync([make_key(0), make_key(1)])
    assert sm.backend("cpu")._index[make_key(0)].get_ref_count() == 1


def test_batched_get_checks_every_key_before_taking_references(make_manager):
    sm = make_manager()
    sm.put_sync(make_key(0), torch.zeros(8))
    with pytest.raises(TypeError):
        sm.batched_get_sync([make_key(0), "not-a-key"])
    assert sm.backend("cpu")._index[make_key(0)].get_ref_count() == 1


def test_default_batched_get_releases_buffers_when_one_get_fails(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], local_cpu=False)
    lower = membackend.last()
    keys = [make_key(i) for i in range(3)]
    _fill_lower(sm, lower, keys)
    lower.fail_keys.add(keys[1])
    assert sm.batched_get_sync(keys) == [None, None, None]  # the tier answered "unknown"
    assert sm.staging_pool.used_bytes == 0


def test_sync_timeouts_racing_results_leak_nothing(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], local_cpu=False, remote_timeout_s=5, blocking_timeout_secs=0.05)
    lower = membackend.last()
    _fill_lower(sm, lower, [make_key(0)])
    lower.delay = 0.05  # answers right around the caller's timeout
    for _ in range(40):
        try:
            obj = sm.get_sync(make_key(0))
        except TimeoutError:
            continue
        if obj is not None:
            obj.ref_count_down()
    time.sleep(0.2)
    assert sm.staging_pool.used_bytes == 0


def test_staged_writes_beyond_the_staging_area_are_bounded(make_manager):
    sm = make_manager(tier_order=["cpu", "testmem"], max_local_cpu_size=2 / 1024, staging_size=0.0)
    membackend.last().delay = 1.0
    accepted = sum(sm.put_sync(make_key(i), t1m(i)) for i in range(20))
    assert accepted <= 4  # the CPU tier's two entries plus one one-off buffer at a time
    assert sm._staging.heap.used_bytes <= MiB


def test_sync_call_in_flight_during_close_gets_a_named_error(make_manager):
    sm = make_manager(tier_order=["cpu", "testremote"], remote_timeout_s=30, blocking_timeout_secs=30)
    membackend.last().mode = "hang"
    errors = []

    def waiter():
        try:
            sm.get_sync(make_key(0))
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    sm.close_sync(flush_timeout=0.1)
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], ManagerClosedError)


@pytest.mark.parametrize("paused_in", ["allocate", "insert"])
def test_a_put_racing_close_leaks_no_buffer(make_manager, paused_in):
    """A put_sync that passed the closed check before close began: paused before its CPU
    insert it gets ManagerClosedError, paused between the insert and the write-through queue
    it returns True; either way every block of the pool is free afterwards."""
    sm = make_manager(tier_order=["cpu", "testremote"])
    pool, cpu = sm.pool, sm.backend("cpu")
    inside, go = threading.Event(), threading.Event()
    original = getattr(cpu, paused_in)

    def paused(*args, **kw):
        if paused_in == "allocate":
            inside.set()
            go.wait(10)
            return original(*args, **kw)
        out = original(*args, **kw)
        inside.set()
        go.wait(10)
        return out

    setattr(cpu, paused_in, paused)
    outcome: list[object] = []

    def putter():
        try:
            outcome.append(sm.put_sync(make_key(7), torch.ones(1024)))
        except ManagerClosedError as exc:
            outcome.append(exc)

    t = threading.Thread(target=putter)
    t.start()
    assert inside.wait(10)
    sm.close_sync()
    go.set()
    t.join(10)
    if paused_in == "allocate":
        assert len(outcome) == 1 and isinstance(outcome[0], ManagerClosedError)
    else:
        assert outcome == [True]
    assert pool is not None and pool.used_bytes == 0


def test_close_lets_go_of_the_pools(make_manager):
    sm = make_manager()
    import weakref

    pool_ref = weakref.ref(sm.pool)
    sm.put_sync(make_key(0), torch.zeros(8))
    sm.close_sync()
    gc.collect()
    assert pool_ref() is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_exits_even_if_a_lock_was_held_at_fork(make_manager):
    sm = make_manager()
    sm.put_sync(make_key(1), torch.zeros(4))
    held, go = threading.Event(), threading.Event()

    def holder():
        with sm.backend("cpu")._lock:
            held.set()
            go.wait()

    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child closes what it inherited, as the exit hook does
        sm.close_sync()
        os._exit(0)
    go.set()
    deadline = time.time() + 10
    while time.time() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("forked child hung closing an inherited manager")


@pytest.mark.slow  # a fresh interpreter importing torch
def test_interpreter_exit_flushes_pending_writes(tmp_path):
    import subprocess
    import sys

    script = f"""
import torch
from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.testing import make_key
cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=1/16, local_disk={str(tmp_path / "d")!r},
                                        max_local_disk_size=1/16, staging_size=1/64)
sm = StorageManager(cfg, LMCacheEngineMetadata("exit"))
for i in range(200):
    sm.put_sync(make_key(i), torch.full((16 * 1024,), i % 256, dtype=torch.uint8))
# no flush, no close: the exit hook must still write everything
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    files = [p for p in (tmp_path / "d").rglob("*.lmc")]
    assert len(files) == 200
