"""StorageManager contract (SPEC §4.3/§4.4), concurrency and shutdown: the async surface from a
foreign event loop, cancellation, sync calls on the loop thread, calls after and during close,
close flushing and letting go of its pools, threads, fork(), interpreter exit, and buffer
ownership when tiers fail, hang or time out. The local path and the lower tiers are in
test_storage_manager.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time

import pytest
import torch
from core._storage_manager_data import MiB, t1m
from support import membackend

from lmcache_async import (
    ForkedProcessError,
    LoopThreadCallError,
    ManagerClosedError,
    MemoryFormat,
    StorageManager,
)
from lmcache_async.testing import make_key


@pytest.fixture(autouse=True)
def _register():
    membackend.register()
    membackend.MemBackend.instances.clear()


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
