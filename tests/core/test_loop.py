"""The loop thread and the sync bridge: misuse raises at once, timeouts cancel, fork is safe."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time

import pytest

from lmcache_async import ForkedProcessError, LoopThreadCallError, ManagerClosedError
from lmcache_async.loop import LoopThread


@pytest.fixture
def lt():
    t = LoopThread("test")
    yield t
    t.stop()


async def _value(v, delay=0.0):
    await asyncio.sleep(delay)
    return v


def test_thread_is_a_named_daemon(lt):
    assert lt.thread.daemon and lt.thread.name == "lmcache-async-test"


def test_run_sync_returns_result(lt):
    assert lt.run_sync(_value(42), timeout=5) == 42


def test_sync_call_on_the_loop_thread_raises_at_once(lt):
    async def inner():
        t0 = time.perf_counter()
        with pytest.raises(LoopThreadCallError):
            lt.run_sync(_value(1), timeout=5)
        return time.perf_counter() - t0

    assert lt.run_sync(inner(), timeout=5) < 1.0


def test_timeout_cancels_the_coroutine(lt):
    started, cancelled = threading.Event(), threading.Event()

    async def slow():
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    coro = slow()
    with pytest.raises(TimeoutError):
        lt.run_sync(coro, timeout=0.2)
    # Cancelled where it waited, or (a loop slower than the timeout) closed before it began.
    assert cancelled.wait(5) or (not started.is_set() and inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED)


def test_coroutine_raising_timeout_error_is_propagated(lt):
    async def boom():
        raise TimeoutError("inner")

    with pytest.raises(TimeoutError, match="inner"):
        lt.run_sync(boom(), timeout=5)


def test_call_after_stop_raises(lt):
    lt.stop()
    with pytest.raises(ManagerClosedError):
        lt.run_sync(_value(1), timeout=1)


async def test_run_async_from_a_foreign_loop(lt):
    assert await lt.run_async(_value(7)) == 7


async def test_cancelling_a_foreign_await_cancels_the_work(lt):
    cancelled = threading.Event()

    started = threading.Event()

    async def slow():
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.ensure_future(lt.run_async(slow()))
    assert await asyncio.to_thread(started.wait, 5)  # it is running on the loop thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.wait(5)


def test_loop_survives_a_failing_task(lt, caplog):
    async def bad():
        raise RuntimeError("backend task died")

    lt.loop.call_soon_threadsafe(lambda: lt.loop.create_task(bad()))
    time.sleep(0.1)
    import gc

    gc.collect()
    assert lt.run_sync(_value(5), timeout=5) == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_gets_a_clear_error_not_a_hang(lt):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            try:
                lt.run_sync(_value(1), timeout=2)
                os.write(w, b"no-error")
            except ForkedProcessError:
                os.write(w, b"forked-error")
            except BaseException as exc:  # pragma: no cover
                os.write(w, type(exc).__name__.encode())
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 100) == b"forked-error"
    os.close(r)
    assert lt.run_sync(_value(2), timeout=5) == 2  # parent unaffected
