"""Remote faults under a mixed load: the server is killed, paused (SIGSTOP) and restarted; a
proxy delays or drops its replies. Every call returns within twice its timeout, nothing raises
into the sync façade, no reply reaches the wrong caller, and the tier recovers.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lmcache_async import ECCacheEngine, LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.memory import MemoryObj

from .chaos_support import FaultProxy, Latencies, chaos_key, entry_size, identity, payload, same_payload, scaled

REMOTE_TIMEOUT = 1.0
BLOCKING_TIMEOUT = 5.0
# Calls that make one remote round trip per tier (get, contains, batched_*) are bounded by the
# tier timeout; every sync call by blocking_timeout_secs.
ONE_TIER_OPS = ("get", "contains", "prefix", "aget", "ec.get")
# Two cores run ~16 busy threads here: a timer may fire a little late.
SCHEDULING_SLACK_S = 0.1


def _manager(url: str, prefix: str, **kw: Any) -> StorageManager:
    base: dict[str, Any] = dict(
        max_local_cpu_size=2 / 1024,  # 2 MiB: most reads fall through to the remote tier
        staging_size=16 / 1024,
        remote_url=url,
        remote_key_prefix=prefix,
        remote_timeout_s=REMOTE_TIMEOUT,
        blocking_timeout_secs=BLOCKING_TIMEOUT,
        remote_part_size=16 << 10,  # many entries are multi-part records
    )
    base.update(kw)
    return StorageManager(LMCacheEngineConfig.from_defaults(**base), LMCacheEngineMetadata("chaos"), name="chaos")


class Load:
    """Sync threads (and optionally an asyncio loop with cancelling tasks) running mixed
    operations until stopped; every result is checked, every latency recorded."""

    def __init__(self, sm: StorageManager, keys: int, threads: int, absent_base: int, seed: int = 1) -> None:
        self.sm = sm
        self.keys = keys
        self.absent_base = absent_base  # ids >= this are never stored
        self.lat = Latencies()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.ops = 0
        self.hits = 0
        self.cancelled = 0
        self._threads = [
            threading.Thread(target=self._run, args=(seed + t,), name=f"chaos-load-{t}", daemon=True)
            for t in range(threads)
        ]
        self._async_thread: threading.Thread | None = None

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as exc:  # nothing may escape into the façade
            self.errors.append(f"{op}: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.lat.add(op, time.perf_counter() - t0)
            self.ops += 1

    def _check(self, obj: MemoryObj | None, i: int) -> None:
        if obj is None:
            return
        try:
            if not same_payload(obj, i, entry_size(i)):
                self.wrong.append(f"key {i} returned the bytes of {identity(obj)}")
            self.hits += 1
        finally:
            obj.ref_count_down()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        sm = self.sm
        while not self.stop.is_set():
            i = rng.randrange(self.keys)
            r = rng.random()
            if r < 0.25:
                self._timed("put", sm.put_sync, chaos_key(i), payload(i, entry_size(i)))
            elif r < 0.6:
                obj = self._timed("get", sm.get_sync, chaos_key(i))
                self._check(obj, i)
            elif r < 0.7:
                j = self.absent_base + rng.randrange(1000)
                obj = self._timed("get", sm.get_sync, chaos_key(j))
                if obj is not None:
                    self.wrong.append(f"never-stored key {j} returned {identity(obj)}")
                    obj.ref_count_down()
            elif r < 0.8:
                j = self.absent_base + rng.randrange(1000)
                if self._timed("contains", sm.contains_sync, chaos_key(j)):
                    self.wrong.append(f"never-stored key {j} reported present")
            elif r < 0.9:
                keys = [chaos_key(i), chaos_key(self.absent_base + rng.randrange(1000))]
                n = self._timed("prefix", sm.prefix_len_sync, keys)
                if n is not None and n > 1:
                    self.wrong.append("batched_contains counted a never-stored key")
            elif r < 0.97:
                objs = self._timed("batched_get", sm.batched_get_sync, [chaos_key(i), chaos_key(i + 1)])
                for k, o in zip((i, i + 1), objs or [None, None], strict=True):
                    self._check(o, k)
            else:
                self._timed("remove", sm.remove_sync, chaos_key(i))

    def start_engine(self, ec: ECCacheEngine) -> None:
        """Also drive an encoder-cache engine (its sync façade) over the same remote tier."""

        def run() -> None:
            rng = random.Random(77)
            while not self.stop.is_set():
                k = rng.randrange(150)
                want = _ec_tensor(k)
                r = rng.random()
                if r < 0.3:
                    self._timed("ec.put", ec.put, f"img-{k}", want)
                elif r < 0.85:
                    got = self._timed("ec.get", ec.get, f"img-{k}")
                    if got is not None:
                        self.hits += 1
                        if not torch.equal(got, want):
                            self.wrong.append(f"EC img-{k} returned other values")
                else:
                    self._timed("ec.contains", ec.contains, f"img-{k}")

        t = threading.Thread(target=run, name="chaos-load-ec", daemon=True)
        self._threads.append(t)
        t.start()

    def start_async(self, tasks: int) -> None:
        """Also run ``tasks`` asyncio tasks that await gets and cancel some of them mid-flight."""

        def main() -> None:
            asyncio.run(self._async_main(tasks))

        self._async_thread = threading.Thread(target=main, name="chaos-load-async", daemon=True)
        self._async_thread.start()

    async def _async_main(self, tasks: int) -> None:
        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while not self.stop.is_set():
                i = rng.randrange(self.keys)
                t0 = time.perf_counter()
                try:
                    # Give up early on a third of the calls: the await is cancelled mid-flight.
                    limit = rng.choice((0.01, 0.05, None))
                    obj = await asyncio.wait_for(self.sm.get(chaos_key(i)), limit)
                except TimeoutError:
                    self.cancelled += 1
                    continue
                except BaseException as exc:
                    self.errors.append(f"aget: {type(exc).__name__}: {exc}")
                    continue
                finally:
                    self.lat.add("aget", time.perf_counter() - t0)
                    self.ops += 1
                self._check(obj, i)

        await asyncio.gather(*(worker(1000 + t) for t in range(tasks)))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(3 * BLOCKING_TIMEOUT)
        if self._async_thread is not None:
            self._async_thread.join(3 * BLOCKING_TIMEOUT)
        alive = [t.name for t in [*self._threads, self._async_thread] if t is not None and t.is_alive()]
        assert not alive, f"load threads hang: {alive}"

    def assert_clean(self) -> None:
        assert not self.errors, f"{len(self.errors)} calls raised into the façade, e.g. {self.errors[:5]}"
        assert not self.wrong, f"{len(self.wrong)} wrong answers, e.g. {self.wrong[:5]}"
        slow = {
            op: max(v)
            for op, v in self.lat.samples.items()
            if max(v) > 2 * (REMOTE_TIMEOUT if op in ONE_TIER_OPS else BLOCKING_TIMEOUT) + SCHEDULING_SLACK_S
        }
        assert not slow, f"calls exceeded twice their timeout: {slow}"


def _ec_tensor(k: int) -> torch.Tensor:
    return torch.arange(64 * (8 + k % 40), dtype=torch.float32).view(-1, 64).add_(k).to(torch.bfloat16)


def _recovered(sm: StorageManager, key_id: int, deadline_s: float) -> float:
    """Seconds until a fresh entry makes a full round trip through the remote tier (put, flush,
    CPU tier emptied, get from the remote tier); fails after ``deadline_s``."""
    t0 = time.monotonic()
    n = entry_size(key_id)
    while time.monotonic() - t0 < deadline_s:
        k = chaos_key(key_id)
        sm.remove_sync(k)
        sm.put_sync(k, payload(key_id, n))
        sm.flush_sync(timeout=4 * REMOTE_TIMEOUT)
        _empty_cpu_tier(sm)
        obj = sm.get_sync(k)
        if obj is not None:
            try:
                assert same_payload(obj, key_id, n), identity(obj)
            finally:
                obj.ref_count_down()
            if sm.stats()["tiers"]["remote"]["circuit"] == "closed":
                return time.monotonic() - t0
        time.sleep(0.2)
    pytest.fail(f"the remote tier did not recover within {deadline_s}s: {sm.stats()['tiers']['remote']}")


def _empty_cpu_tier(sm: StorageManager) -> None:
    """Evict every CPU entry nobody holds (allocate the whole pool, give it back)."""
    if sm.pool is None:
        return
    block = sm.allocate((sm.pool.capacity,), torch.uint8)
    if block is not None:
        block.ref_count_down()


def test_server_killed_paused_and_restarted_under_mixed_load(own_redis, figures):
    srv = own_redis

    def kill() -> None:
        srv.kill()
        time.sleep(1.0)
        srv.restart()

    def pause() -> None:
        srv.pause()
        time.sleep(1.5)
        srv.resume()

    def pause_then_kill() -> None:
        srv.pause()
        time.sleep(0.5)
        srv.kill()
        srv.restart()

    sm = _manager(srv.url, "chaos-kill")
    ec_cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 1024,
        staging_size=4 / 1024,
        remote_url=srv.url,
        remote_key_prefix="chaos-kill-ec",
        remote_timeout_s=REMOTE_TIMEOUT,
        blocking_timeout_secs=BLOCKING_TIMEOUT,
    )
    ec = ECCacheEngine(ec_cfg, LMCacheEngineMetadata("chaos/vision"), "bfloat16")
    faults = 0
    recoveries: list[float] = []
    try:
        with Load(sm, keys=300, threads=4, absent_base=1_000_000) as load:
            load.start_async(8)
            load.start_engine(ec)
            time.sleep(0.5)
            for _ in range(scaled(1)):
                for fault in (kill, pause, pause_then_kill):
                    fault()
                    faults += 1
                    recoveries.append(_recovered(sm, 5_000_000 + faults, deadline_s=45))
        load.assert_clean()
        st = sm.stats()["tiers"]["remote"]
        assert st["foreign"] == 0 and st["corrupt"] == 0, st
        figures(
            "remote faults: server kill/pause/restart",
            faults_injected=faults,
            calls=load.ops,
            hits_checked=load.hits,
            cancelled_awaits=load.cancelled,
            errors_raised=len(load.errors),
            wrong_answers=len(load.wrong),
            tier_errors=st["errors"],
            tier_timeouts=st["timeouts"],
            max_call_ms=round(load.lat.maximum() * 1e3, 1),
            max_recovery_s=round(max(recoveries), 2),
            remote_timeout_s=REMOTE_TIMEOUT,
        )
    finally:
        ec.close()
        sm.close_sync()


@pytest.mark.parametrize("cpu_tier", [False, True], ids=["remote-only", "cpu+remote"])
def test_proxy_delaying_and_dropping_replies_crosses_nothing(shared_redis, cpu_tier, figures):
    with FaultProxy("127.0.0.1", shared_redis.port) as proxy:
        sm = _manager(proxy.url, f"chaos-proxy-{int(cpu_tier)}", local_cpu=cpu_tier)
        try:
            keys = 200
            for i in range(keys):
                assert sm.put_sync(chaos_key(i), payload(i, entry_size(i)))
            sm.flush_sync(timeout=30)
            phases: list[tuple[str, float, float, bool]] = [
                ("delay", 0.2 * REMOTE_TIMEOUT, 0.1 * REMOTE_TIMEOUT, False),  # slow but in time
                ("delay", REMOTE_TIMEOUT, 0.5 * REMOTE_TIMEOUT, False),  # replies straddle the timeout
                ("drop", 0.0, 0.0, False),
                ("delay", 1.5 * REMOTE_TIMEOUT, 0.0, True),  # every reply late, then connections cut
            ]
            faults = 0
            recoveries: list[float] = []
            with Load(sm, keys=keys, threads=4, absent_base=2_000_000) as load:
                load.start_async(8)
                time.sleep(0.5)
                for _ in range(scaled(1)):
                    for mode, delay, jitter, reset in phases:
                        proxy.set(mode, delay, jitter)
                        faults += 1
                        time.sleep(1.5)
                        if reset:
                            proxy.reset_all()
                            faults += 1
                        proxy.set("pass")
                        recoveries.append(_recovered(sm, 6_000_000 + faults, deadline_s=45))
            load.assert_clean()
            # Every stored entry is still served byte-exact through the same connections.
            _empty_cpu_tier(sm)
            for i in range(0, keys, 7):
                obj = sm.get_sync(chaos_key(i))
                if obj is not None:
                    try:
                        assert same_payload(obj, i, entry_size(i)), (i, identity(obj))
                    finally:
                        obj.ref_count_down()
            st = sm.stats()["tiers"]["remote"]
            assert st["foreign"] == 0 and st["corrupt"] == 0, st
            figures(
                "remote faults: proxy delays/drops replies",
                faults_injected=faults,
                calls=load.ops,
                hits_checked=load.hits,
                cancelled_awaits=load.cancelled,
                replies_delayed=proxy.replies_delayed,
                replies_dropped=proxy.replies_dropped,
                errors_raised=len(load.errors),
                wrong_answers=len(load.wrong),
                crossed_replies=st["foreign"],
                tier_timeouts=st["timeouts"],
                max_call_ms=round(load.lat.maximum() * 1e3, 1),
                max_recovery_s=round(max(recoveries), 2),
            )
        finally:
            sm.close_sync()
        pool = sm.staging_pool
        assert pool is None or pool.used_bytes == 0, "a staging buffer leaked"
