"""Opening without blocking the caller's loop, closing from anywhere, warning when left open."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.errors import ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.testing import make_key
from lmcache_async.tiers import Allocate, BackendContext, StorageBackend, register_backend


class GatedStart(StorageBackend):
    """A lower tier whose ``start`` waits for ``gate`` (set by a task of the opener's loop)."""

    name = "testgated"
    gate = threading.Event()
    saw_gate: list[bool] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        GatedStart.saw_gate.append(await loop.run_in_executor(None, GatedStart.gate.wait, 10.0))

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return False

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return None

    async def contains(self, key: CacheEngineKey) -> bool:
        return False

    async def remove(self, key: CacheEngineKey) -> bool:
        return False


def _gated(ctx: BackendContext) -> GatedStart:
    return GatedStart()


register_backend("testgated", _gated, replace=True)


async def test_open_does_not_block_the_callers_loop_while_tiers_start(small_config, metadata) -> None:
    GatedStart.gate.clear()
    GatedStart.saw_gate.clear()

    async def open_the_gate() -> None:  # runs only if open() leaves this loop free
        await asyncio.sleep(0)
        GatedStart.gate.set()

    opener = asyncio.ensure_future(StorageManager.open(small_config(tier_order=["cpu", "testgated"]), metadata))
    await open_the_gate()
    sm = await opener
    try:
        assert GatedStart.saw_gate == [True]
        assert sm.tier_names == ["cpu", "testgated"] and not sm.closed
    finally:
        await sm.aclose()
    assert sm.closed


async def test_async_with_open_closes_on_exit(small_config, metadata) -> None:
    async with StorageManager.open(small_config(), metadata) as sm:
        assert await sm.put(make_key(0), torch.zeros(4))
        assert await sm.contains(make_key(0))
    assert sm.closed
    with pytest.raises(ManagerClosedError):
        await sm.get(make_key(0))


async def test_open_checks_its_arguments(metadata) -> None:
    with pytest.raises(TypeError, match="config"):
        await StorageManager.open({"local_cpu": True}, metadata)  # type: ignore[arg-type]


async def test_aclose_from_a_foreign_loop_is_idempotent(make_manager) -> None:
    sm = make_manager()
    await sm.aclose()
    await sm.aclose()
    await sm.close()
    assert sm.closed


def test_aclose_awaited_on_the_managers_own_loop_neither_raises_nor_deadlocks(make_manager) -> None:
    sm = make_manager(tier_order=["cpu", "testgated"])
    sm.put_sync(make_key(1), torch.zeros(4))

    async def close_here() -> str:
        await sm.aclose()
        return "closed"

    assert sm.loop_thread.submit(close_here()).result(30) == "closed"
    assert sm.closed
    sm.loop_thread.thread.join(10)
    assert not sm.loop_thread.thread.is_alive()


def test_the_constructor_starts_no_metrics_server(make_manager) -> None:
    from lmcache_async.testing.servers import free_port

    port = free_port()
    make_manager(metrics_port=port)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port is still free


def test_a_manager_collected_unclosed_warns_and_is_closed(small_config, metadata) -> None:
    sm = StorageManager(small_config(), metadata)
    lt = sm.loop_thread
    with pytest.warns(ResourceWarning, match="garbage-collected unclosed"):
        del sm
        gc.collect()
    lt.thread.join(10)
    assert lt.closed and not lt.thread.is_alive()


def test_a_manager_whose_start_failed_does_not_warn(small_config, metadata) -> None:
    def broken(ctx: BackendContext) -> Any:
        raise OSError("cannot build this tier")

    register_backend("testbroken", broken, replace=True)
    with pytest.raises(OSError):
        StorageManager(small_config(tier_order=["cpu", "testbroken"]), metadata)
    gc.collect()  # filterwarnings=error: a ResourceWarning here would fail the test
