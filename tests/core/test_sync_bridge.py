"""Every ``*_sync`` twin comes from its coroutine through one bridge: same bound, same errors."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest
import torch
from support import membackend

from lmcache_async import StorageManager
from lmcache_async.errors import LoopThreadCallError
from lmcache_async.sync_bridge import SyncBridge
from lmcache_async.testing import make_key
from lmcache_async.tiers import Presence

membackend.register()

TWINS = [
    "put",
    "batched_put",
    "get",
    "batched_get",
    "contains",
    "presence",
    "prefix_len",
    "remove",
    "clear",
    "flush",
]


def _hung_remote(make_manager, **overrides):
    """A manager whose only lower tier, once hung, times out (5 s) long after blocking_timeout_secs."""
    sm = make_manager(tier_order=["cpu", "testremote"], remote_timeout_s=5, blocking_timeout_secs=0.3, **overrides)
    tier = membackend.last()
    return sm, tier


@pytest.mark.parametrize("name", TWINS)
def test_each_sync_twin_takes_the_arguments_of_its_coroutine(name: str) -> None:
    coro = getattr(StorageManager, name)
    twin = getattr(StorageManager, f"{name}_sync")
    assert inspect.iscoroutinefunction(coro) and not inspect.iscoroutinefunction(twin)
    assert inspect.signature(twin) == inspect.signature(coro)
    assert twin.__name__ == f"{name}_sync"


def test_clear_sync_is_bounded_by_blocking_timeout(make_manager) -> None:
    sm, tier = _hung_remote(make_manager)
    sm.put_sync(make_key(0), torch.zeros(8))
    sm.flush_sync()
    tier.mode = "hang"
    with pytest.raises(TimeoutError):
        sm.clear_sync()
    assert sm.stats()["tiers"]["cpu"]["entries"] == 0


def test_flush_sync_is_bounded_by_blocking_timeout_and_the_write_goes_on(make_manager) -> None:
    sm, tier = _hung_remote(make_manager)
    tier.mode = "hang"
    sm.put_sync(make_key(0), torch.zeros(8))
    with pytest.raises(TimeoutError):
        sm.flush_sync()
    tier.mode = "ok"
    assert sm.stats()["pending_writes"] == 1  # given up on by the caller, not cancelled
    sm.flush_sync(timeout=10)
    assert sm.stats()["pending_writes"] == 0


async def test_flush_awaited_is_bounded_like_its_twin(make_manager) -> None:
    sm, tier = _hung_remote(make_manager)
    tier.mode = "hang"
    await sm.put(make_key(0), torch.zeros(8))
    with pytest.raises(TimeoutError):
        await sm.flush()


async def test_presence_awaited_and_sync_both_map_the_bound_to_unknown(make_manager) -> None:
    sm, tier = _hung_remote(make_manager)
    tier.mode = "hang"
    assert await sm.presence(make_key(5)) is Presence.UNKNOWN
    assert await asyncio.to_thread(sm.presence_sync, make_key(5)) is Presence.UNKNOWN
    # Both gave up at blocking_timeout_secs, before the tier's own 5 s timeout counted.
    assert sm.stats()["tiers"]["testremote"]["timeouts"] == 0


async def test_contains_awaited_and_sync_both_raise_the_bound(make_manager) -> None:
    sm, tier = _hung_remote(make_manager)
    tier.mode = "hang"
    with pytest.raises(TimeoutError):
        await sm.contains(make_key(5))
    with pytest.raises(TimeoutError):
        await asyncio.to_thread(sm.contains_sync, make_key(5))


def test_batched_get_sync_bound_releases_local_hits(make_manager) -> None:
    sm, tier = _hung_remote(make_manager)
    sm.put_sync(make_key(0), torch.zeros(8))
    sm.flush_sync()
    tier.mode = "hang"
    with pytest.raises(TimeoutError):
        sm.batched_get_sync([make_key(0), make_key(1)])
    entry = sm.lookup_local(make_key(0))
    assert entry is not None and entry.get_ref_count() == 2  # the index's and this lookup's
    entry.ref_count_down()


@pytest.mark.parametrize("name", ["put", "get", "contains", "prefix_len", "clear", "flush"])
def test_sync_twins_refuse_the_loop_thread(make_manager, name: str) -> None:
    sm = make_manager()
    args = {
        "put": (make_key(0), torch.zeros(4)),
        "get": (make_key(0),),
        "contains": (make_key(0),),
        "prefix_len": ([make_key(0)],),
        "clear": (),
        "flush": (),
    }[name]

    async def on_loop() -> None:
        getattr(sm, f"{name}_sync")(*args)

    with pytest.raises(LoopThreadCallError):
        sm.loop_thread.submit(on_loop()).result(10)


def test_a_local_hit_never_crosses_to_a_busy_loop(make_manager) -> None:
    sm, _ = _hung_remote(make_manager)
    sm.put_sync(make_key(0), torch.zeros(8))
    release = threading.Event()

    async def block_the_loop() -> None:
        release.wait(30)  # the loop thread is stuck: any hop would time out

    fut = sm.loop_thread.submit(block_the_loop())
    try:
        assert sm.contains_sync(make_key(0))
        obj = sm.get_sync(make_key(0))
        assert obj is not None
        obj.ref_count_down()
        assert sm.prefix_len_sync([make_key(0)]) == 1
        assert sm.put_sync(make_key(1), torch.ones(8))
    finally:
        release.set()
        fut.result(10)


def test_an_operation_that_awaits_something_else_is_refused(make_manager) -> None:
    sm = make_manager()
    bridge: SyncBridge = sm.bridge

    async def op() -> int:
        await asyncio.sleep(0)
        return 1

    with pytest.raises(TypeError, match="not a Hop"):
        bridge.run(op())
