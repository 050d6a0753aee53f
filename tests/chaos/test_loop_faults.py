"""Loop faults: a backend task that dies, a backend that never answers, ``close()`` with work in
flight, sync calls from the loop thread, from many threads at once, after close and after
fork. Nothing hangs (the suite runs under ``faulthandler_timeout``), misuse gets a clear named
error, and every buffer goes back to its pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import (
    ECCacheEngine,
    ForkedProcessError,
    LMCacheEngine,
    LMCacheEngineConfig,
    LMCacheEngineMetadata,
    LoopThreadCallError,
    ManagerClosedError,
    StorageManager,
)
from lmcache_async.errors import MisuseError

from .chaos_support import FaultyBackend, chaos_key, entry_size, identity, payload, register_faulty, same_payload

REMOTE_TIMEOUT = 0.5
BLOCKING_TIMEOUT = 3.0


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[Callable[..., tuple[StorageManager, FaultyBackend]]]:
    """``faulty(remote=True, **config)`` -> a manager over CPU + a fault-injecting tier on real
    files, and that tier. Closed (and checked for leaked buffers) at the end."""
    register_faulty()
    made: list[StorageManager] = []

    def make(remote: bool = True, **kw: Any) -> tuple[StorageManager, FaultyBackend]:
        base: dict[str, Any] = dict(
            max_local_cpu_size=4 / 1024,
            staging_size=4 / 1024,
            tier_order=["cpu", FaultyBackend.name],
            remote_timeout_s=REMOTE_TIMEOUT,
            blocking_timeout_secs=BLOCKING_TIMEOUT,
            extra_config={"chaos_root": str(tmp_path / f"store{len(made)}"), "chaos_remote": remote},
        )
        base.update(kw)
        sm = StorageManager(LMCacheEngineConfig.from_defaults(**base), LMCacheEngineMetadata("chaos"), name="chaos")
        made.append(sm)
        return sm, FaultyBackend.instances[-1]

    yield make
    for be in FaultyBackend.instances:
        be.fault = None
    FaultyBackend.instances.clear()
    for sm in made:
        sm.close_sync(flush_timeout=2.0)
        assert_released(sm)


def assert_released(sm: StorageManager) -> None:
    """Every pool of a closed manager whose references were all dropped is back to 0 bytes."""
    for pool in (sm.pool, sm.staging_pool):
        if pool is not None:
            assert pool.used_bytes == 0 and pool.num_objects == 0, f"{pool.name}: {pool.stats()}"
    assert sm._staging.heap.used_bytes == 0, "a one-off read buffer leaked"


def evict_cpu(sm: StorageManager) -> None:
    assert sm.pool is not None
    block = sm.allocate((sm.pool.capacity,), torch.uint8)
    if block is not None:
        block.ref_count_down()


def round_trip(sm: StorageManager, i: int) -> None:
    """put, flush, evict the CPU tier, get from the lower tier: byte-exact."""
    n = entry_size(i)
    assert sm.put_sync(chaos_key(i), payload(i, n))
    sm.flush_sync(timeout=10)
    evict_cpu(sm)
    obj = sm.get_sync(chaos_key(i))
    assert obj is not None, sm.stats()["tiers"]
    with obj:
        assert same_payload(obj, i, n), identity(obj)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---- a backend task dies / a backend raises -----------------------------------------------------------
@pytest.mark.parametrize("fault", ["task-dies", "raise"])
def test_failing_backend_never_takes_the_loop_down(faulty, fault, caplog, figures):
    sm, be = faulty()
    now = [time.monotonic()]
    sm._lower[0].breaker.clock = lambda: now[0]  # an injected clock: no sleep past the back-off
    for i in range(20):
        assert sm.put_sync(chaos_key(i), payload(i, entry_size(i)))
    sm.flush_sync(timeout=10)
    be.fault = fault
    with caplog.at_level(logging.ERROR, logger="lmcache_async.loop"):
        for i in range(20, 60):
            assert sm.put_sync(chaos_key(i), payload(i, entry_size(i)))
        sm.flush_sync(timeout=10)
        evict_cpu(sm)
        for i in range(60):
            obj = sm.get_sync(chaos_key(i))  # a miss or the right bytes, never an exception
            if obj is not None:
                with obj:
                    assert same_payload(obj, i, entry_size(i))
            sm.contains_sync(chaos_key(i))
        time.sleep(0.1)
    tier = sm.stats()["tiers"][FaultyBackend.name]
    if fault == "task-dies":
        assert be.tasks_died > 0
        assert any("injected failure in a backend task" in str(r.exc_info) for r in caplog.records), caplog.text
    else:
        assert tier["errors"] > 0 and tier["write_failures"] > 0, tier
    be.fault = None
    now[0] += 1.1  # past the circuit breaker's back-off
    round_trip(sm, 1000)  # the loop and the tier still work
    figures(f"loop faults: backend {fault}", calls=be.calls, tier_errors=tier["errors"], tasks_died=be.tasks_died)


# ---- a backend that never answers ------------------------------------------------------------------------
@pytest.mark.parametrize("remote", [True, False], ids=["remote-tier", "local-tier"])
def test_backend_that_never_answers_costs_one_timeout(faulty, remote, figures):
    sm, be = faulty(remote=remote)
    bound = REMOTE_TIMEOUT if remote else BLOCKING_TIMEOUT / 2
    be.fault = "hang"
    for i in range(8):  # one write batch: the manager gives a batch one timeout per 8 entries
        assert sm.put_sync(chaos_key(i), payload(i, entry_size(i)))
    _, flush_s = timed(lambda: sm.flush_sync(timeout=4 * bound + 5))  # the write-through times out
    worst = 0.0
    for i in range(50, 56):  # not in the CPU tier: the hung tier is asked
        obj, dt = timed(functools.partial(sm.get_sync, chaos_key(i)))
        assert obj is None
        worst = max(worst, dt)
        _, dt = timed(functools.partial(sm.contains_sync, chaos_key(i)))
        worst = max(worst, dt)
        _, dt = timed(lambda: sm.prefix_len_sync([chaos_key(50), chaos_key(51)]))
        worst = max(worst, dt)
    assert worst <= 2 * bound, f"a call against a hung tier took {worst:.2f}s (timeout {bound}s)"
    assert flush_s <= 2 * bound, f"flushing into a hung tier took {flush_s:.2f}s (timeout {bound}s)"
    with sm.get_sync(chaos_key(3)) as obj:  # the CPU tier still answers
        assert same_payload(obj, 3, entry_size(3))
    _, close_s = timed(lambda: sm.close_sync(flush_timeout=1.0))
    assert close_s < 1.0 + max(bound, 5.0) + 5.0, f"close with a hung tier took {close_s:.1f}s"
    assert_released(sm)
    figures(
        "loop faults: backend never answers",
        hung_calls=be.hung,
        max_call_ms=round(worst * 1e3, 1),
        max_flush_ms=round(flush_s * 1e3, 1),
        max_close_ms=round(close_s * 1e3, 1),
    )


# ---- close() with work in flight -----------------------------------------------------------------------
def _hammer(sm: StorageManager, seed: int, stop: threading.Event, errors: list[str], closed: list[int]) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(64)
        try:
            r = rng.random()
            if r < 0.4:
                sm.put_sync(chaos_key(i), payload(i, entry_size(i)))
            elif r < 0.8:
                obj = sm.get_sync(chaos_key(i))
                if obj is not None:
                    with obj:
                        if not same_payload(obj, i, entry_size(i)):
                            errors.append(f"wrong bytes for {i}: {identity(obj)}")
            elif r < 0.9:
                sm.prefix_len_sync([chaos_key(i), chaos_key(i + 1)])
            elif r < 0.95:
                sm.remove_sync(chaos_key(i))
            else:
                sm.flush_sync(timeout=BLOCKING_TIMEOUT)
        except ManagerClosedError:
            closed.append(1)
            return
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return


@pytest.mark.parametrize("closer", ["close_sync", "close-from-foreign-loop"])
def test_close_with_work_in_flight(faulty, closer, figures):
    sm, be = faulty(remote=True)
    be.fault = None
    stop = threading.Event()
    errors: list[str] = []
    closed: list[int] = []
    threads = [
        threading.Thread(target=_hammer, args=(sm, s, stop, errors, closed), name=f"chaos-close-{s}", daemon=True)
        for s in range(8)
    ]
    aborted: list[str] = []

    async def async_load() -> None:
        async def one(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                i = rng.randrange(64)
                try:
                    obj = await sm.get(chaos_key(i))
                    if obj is not None:
                        obj.ref_count_down()
                    await sm.put(chaos_key(i), payload(i, entry_size(i)))
                except ManagerClosedError:
                    aborted.append("closed")
                    return
                except BaseException as exc:
                    errors.append(f"async {type(exc).__name__}: {exc}")
                    return

        await asyncio.gather(*(one(100 + s) for s in range(16)))

    loop_thread = threading.Thread(target=lambda: asyncio.run(async_load()), name="chaos-close-async", daemon=True)
    for t in threads:
        t.start()
    loop_thread.start()
    time.sleep(0.7)
    t0 = time.perf_counter()
    if closer == "close_sync":
        sm.close_sync(flush_timeout=5.0)
    else:
        asyncio.run(sm.close(flush_timeout=5.0))
    close_s = time.perf_counter() - t0
    time.sleep(0.2)
    stop.set()
    for t in [*threads, loop_thread]:
        t.join(2 * BLOCKING_TIMEOUT)
        assert not t.is_alive(), f"{t.name} hangs after close"
    assert not errors, errors[:5]
    assert closed, "no caller saw ManagerClosedError"
    with pytest.raises(ManagerClosedError):
        sm.get_sync(chaos_key(1))
    assert_released(sm)
    figures(
        "loop faults: close with work in flight",
        trials=1,
        callers=24,
        callers_told_closed=len(closed) + len(aborted),
        max_close_ms=round(close_s * 1e3, 1),
    )


# ---- sync calls from the loop thread --------------------------------------------------------------------
def test_sync_calls_from_the_loop_thread_raise_at_once(faulty, tmp_path, metadata):
    sm, _ = faulty()
    k = chaos_key(1)
    calls: dict[str, Callable[[], Any]] = {
        "put_sync": lambda: sm.put_sync(k, torch.zeros(4)),
        "get_sync": lambda: sm.get_sync(k),
        "contains_sync": lambda: sm.contains_sync(k),
        "batched_get_sync": lambda: sm.batched_get_sync([k]),
        "prefix_len_sync": lambda: sm.prefix_len_sync([k]),
        "remove_sync": lambda: sm.remove_sync(k),
        "flush_sync": lambda: sm.flush_sync(),
        "clear_sync": lambda: sm.clear_sync(),
        "close_sync": lambda: sm.close_sync(),
    }

    async def on_loop() -> dict[str, str]:
        out = {}
        for name, fn in calls.items():
            t0 = time.perf_counter()
            try:
                fn()
                out[name] = "returned"
            except LoopThreadCallError:
                out[name] = "raised" if time.perf_counter() - t0 < 1.0 else "raised late"
            except BaseException as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        return out

    got = sm.loop_thread.run_sync(on_loop(), timeout=30)
    assert got == dict.fromkeys(calls, "raised"), got

    ec = ECCacheEngine(
        LMCacheEngineConfig.from_defaults(max_local_cpu_size=1 / 64, staging_size=1 / 64), metadata, "bfloat16"
    )
    try:

        async def ec_on_loop() -> list[str]:
            out = []
            for fn in (lambda: ec.get("x"), lambda: ec.contains("x"), lambda: ec.delete("x"), ec.close):
                try:
                    fn()
                    out.append("returned")
                except LoopThreadCallError:
                    out.append("raised")
            return out

        res = ec.storage_manager.loop_thread.run_sync(ec_on_loop(), timeout=30)
        # A CPU hit/miss is answered on the caller's thread without the loop; a call that needs
        # the loop (or close) must raise rather than deadlock.
        assert "raised" in res and res[-1] == "raised", res
        assert ec.put("y", torch.ones(3)) and ec.get("y") is not None
    finally:
        ec.close()


# ---- many threads at once ---------------------------------------------------------------------------------
def test_many_threads_at_once_stay_consistent(faulty, figures):
    sm, _ = faulty()
    errors: list[str] = []
    hits = [0]
    n_threads, ops = 32, 250

    def run(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(ops):
            i = rng.randrange(96)
            try:
                r = rng.random()
                if r < 0.35:
                    sm.put_sync(chaos_key(i), payload(i, entry_size(i, hi=16 << 10)))
                elif r < 0.75:
                    obj = sm.get_sync(chaos_key(i))
                    if obj is not None:
                        with obj:
                            if not same_payload(obj, i, entry_size(i, hi=16 << 10)):
                                errors.append(f"wrong bytes for {i}: {identity(obj)}")
                            hits[0] += 1
                elif r < 0.85:
                    objs = sm.batched_get_sync([chaos_key(i), chaos_key(i + 1)])
                    for o in objs:
                        if o is not None:
                            o.ref_count_down()
                elif r < 0.95:
                    sm.contains_sync(chaos_key(i))
                else:
                    sm.remove_sync(chaos_key(i))
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(s,), name=f"chaos-many-{s}", daemon=True) for s in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a caller thread hangs"
    assert not errors, errors[:5]
    sm.clear_sync()
    assert sm.pool is not None and sm.pool.used_bytes == 0
    assert sm.staging_pool is not None and sm.staging_pool.used_bytes == 0
    figures("loop faults: many threads", threads=n_threads, calls=n_threads * ops, hits_checked=hits[0])


# ---- after close -------------------------------------------------------------------------------------------
def test_every_call_after_close_raises_a_clear_error(faulty, metadata):
    sm, _ = faulty()
    sm.put_sync(chaos_key(1), torch.ones(8))
    sm.close_sync()
    sm.close_sync()  # idempotent
    k = chaos_key(1)
    sync_calls = [
        lambda: sm.put_sync(k, torch.zeros(4)),
        lambda: sm.get_sync(k),
        lambda: sm.contains_sync(k),
        lambda: sm.batched_get_sync([k]),
        lambda: sm.prefix_len_sync([k]),
        lambda: sm.remove_sync(k),
        lambda: sm.flush_sync(),
        lambda: sm.clear_sync(),
        lambda: sm.allocate((4,), torch.uint8),
    ]
    for fn in sync_calls:
        with pytest.raises(ManagerClosedError):
            fn()

    async def async_calls() -> None:
        for coro_fn in (
            lambda: sm.put(k, torch.zeros(4)),
            lambda: sm.get(k),
            lambda: sm.contains(k),
            lambda: sm.batched_get([k]),
            lambda: sm.prefix_len([k]),
            lambda: sm.remove(k),
            lambda: sm.flush(),
            lambda: sm.clear(),
        ):
            with pytest.raises(ManagerClosedError):
                await coro_fn()
        await sm.close()  # idempotent from a foreign loop too

    asyncio.run(async_calls())

    kv = LMCacheEngine(LMCacheEngineConfig.from_defaults(max_local_cpu_size=1 / 64, staging_size=1 / 64), metadata)
    ec = ECCacheEngine(
        LMCacheEngineConfig.from_defaults(max_local_cpu_size=1 / 64, staging_size=1 / 64), metadata, "float16"
    )
    kv.close()
    ec.close()
    for fn in (
        lambda: kv.store(list(range(256)), torch.zeros(2, 1, 256, 4)),
        lambda: kv.retrieve(list(range(256))),
        lambda: kv.lookup(list(range(256))),
        lambda: ec.put("a", torch.zeros(2)),
        lambda: ec.get("a"),
        lambda: ec.contains("a"),
    ):
        with pytest.raises(ManagerClosedError):
            fn()


# ---- after fork ------------------------------------------------------------------------------------------------
CHILD_OK = 0
CHILD_WRONG = 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_after_fork_the_child_gets_clear_errors_and_can_start_afresh(faulty, tmp_path):
    sm, _ = faulty()
    for i in range(4):
        sm.put_sync(chaos_key(i), payload(i, 64))
    sm.flush_sync(timeout=10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = CHILD_WRONG
        try:
            os.close(r)
            code = _child_checks(sm, tmp_path)
        except BaseException as exc:  # pragma: no cover - reported through the pipe
            os.write(w, f"child crashed: {type(exc).__name__}: {exc}".encode()[:500])
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 60
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    msg = os.read(r, 4096).decode(errors="replace")
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == CHILD_OK, msg
    with sm.get_sync(chaos_key(2)) as obj:  # the parent is unaffected
        assert same_payload(obj, 2, 64)


def _child_checks(sm: StorageManager, tmp_path: Path) -> int:
    k = chaos_key(1)
    calls = [
        lambda: sm.put_sync(chaos_key(99), torch.zeros(4)),
        lambda: sm.get_sync(k),
        lambda: sm.contains_sync(k),
        lambda: sm.prefix_len_sync([k]),
        lambda: sm.remove_sync(k),
        lambda: sm.flush_sync(),
        lambda: sm.allocate((4,), torch.uint8),
    ]
    for fn in calls:
        t0 = time.monotonic()
        try:
            fn()
            return CHILD_WRONG
        except ForkedProcessError:
            if time.monotonic() - t0 > 1.0:
                return CHILD_WRONG
        except MisuseError:
            return CHILD_WRONG

    async def awaited() -> bool:
        try:
            await sm.get(k)
        except ForkedProcessError:
            return True
        return False

    if not asyncio.run(awaited()):
        return CHILD_WRONG
    sm.close_sync()  # no hang, no error: the child just lets go of the parent's manager
    register_faulty()
    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 256,
        staging_size=1 / 256,
        tier_order=["cpu", FaultyBackend.name],
        extra_config={"chaos_root": str(tmp_path / "child-store"), "chaos_remote": True},
    )
    with StorageManager(cfg, LMCacheEngineMetadata("child"), name="child") as fresh:
        fresh.put_sync(k, payload(1, 64))
        fresh.flush_sync(timeout=10)
        obj = fresh.get_sync(k)
        if obj is None:
            return CHILD_WRONG
        with obj:
            if not same_payload(obj, 1, 64):
                return CHILD_WRONG
    return CHILD_OK
