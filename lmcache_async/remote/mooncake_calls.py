"""How the Mooncake tier runs its blocking calls: worker threads, a timeout, and recovery.

Every Mooncake call blocks, so :class:`MooncakeCalls` runs each job (``fn(client, *args)``) on
the tier's own bounded pool of worker threads. A job that has not finished after the timeout is
abandoned: its caller gets :class:`MooncakeTimeout` at once while the thread finishes it (a dead
master holds a call for seconds, a hung one for tens of seconds); the buffers it uses stay
referenced until it returns (the caller's ``after``/``orphan`` hooks run then), so nothing is
released under it. The first timeout (or a job raising :class:`MooncakeUnavailable`) marks the
store down: further jobs are refused without touching a thread until a probe (``is_exist``;
``health_check`` keeps answering "healthy" after the master died) succeeds, and once as many
abandoned jobs are still running as there are threads, jobs are refused too. A successful probe
sets up a fresh client (a restarted master has forgotten the old one), registers the tier's
memory with it, and jobs run again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache_async.ratelog import RateLimitedLog

from .mooncake_store import RPC_FAIL, MooncakeClient, MooncakeSettings, MooncakeUnavailable

__all__ = ["PROBE_INTERVAL_S", "PROBE_KEY", "MooncakeCalls", "MooncakeTimeout"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_KEY = "lmcache-async:probe"
"""The key the recovery probe asks about (it never exists)."""
PROBE_INTERVAL_S = 0.25
"""Least time between two recovery probes while the store is down."""
_ENTRIES_PER_TIMEOUT = 64  # a batch gets one timeout per this many entries (as the manager does)


class MooncakeTimeout(TimeoutError):
    """A Mooncake call did not finish within the tier's timeout (it was abandoned)."""


class _Generation:
    """One set-up client and the worker-thread jobs currently using it."""

    __slots__ = ("client", "retired", "users")

    def __init__(self, client: MooncakeClient) -> None:
        self.client = client
        self.users = 0
        self.retired = False


class MooncakeCalls:
    """The worker threads, the client generations and the down/probe state of one tier.

    ``regions`` (``(address, size)``) are registered with every client set up. Coroutines run
    on the caller's loop; jobs on the threads ``<thread_name>_<i>``. Construction starts
    nothing; the first :meth:`run` sets the first client up (it is a probe)."""

    def __init__(
        self,
        settings: MooncakeSettings,
        regions: Sequence[tuple[int, int]],
        *,
        timeout_s: float,
        workers: int,
        thread_name: str,
        log: RateLimitedLog,
    ) -> None:
        self._settings = settings
        self._regions = list(regions)
        self.timeout_s = timeout_s
        self.workers = workers
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name)
        self._log = log
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._gen: _Generation | None = None
        self._down = True  # until the first client is set up
        self._down_since = time.monotonic()
        self._next_probe = 0.0
        self._probe: tuple[int, float] | None = None  # (token, start) of the running probe
        self._probe_token = 0
        self._abandoned = 0
        self._closed = False
        # counters
        self.refused = 0
        self.abandoned_calls = 0
        self.setups = 0
        self.last_recovery_s: float | None = None

    # ---- state -------------------------------------------------------------------------------------
    def mark_down(self, why: str) -> None:
        """Refuse jobs until a probe succeeds (any thread)."""
        with self._lock:
            if self._down:
                return
            self._down = True
            self._down_since = time.monotonic()
            self._next_probe = self._down_since + PROBE_INTERVAL_S
        self._log.warning("mooncake tier: store unreachable (%s); calls are refused until a probe succeeds", why)

    def stats(self) -> dict[str, Any]:
        """``refused``, ``abandoned_calls``, ``in_flight_abandoned``, ``setups``, ``store_down``,
        ``last_recovery_s`` (store marked down -> new client set up)."""
        with self._lock:
            down, abandoned = self._down, self._abandoned
        return {
            "refused": self.refused,
            "abandoned_calls": self.abandoned_calls,
            "in_flight_abandoned": abandoned,
            "setups": self.setups,
            "store_down": down,
            "last_recovery_s": self.last_recovery_s,
        }

    # ---- on the worker threads -------------------------------------------------------------------
    def _enter(self, probe: bool) -> _Generation:
        """The client a job uses (counted as one of its users); a probe recovers first."""
        with self._lock:
            if self._closed:
                raise MooncakeUnavailable("call after close", RPC_FAIL)
            gen = self._gen
            if not probe and (self._down or gen is None):  # queued before the store went down
                raise MooncakeUnavailable("call while the store is down", RPC_FAIL)
            if gen is not None:
                gen.users += 1  # a probe asks through the old client: it must stay open meanwhile
            if not probe:
                assert gen is not None
                return gen
        return self._recover(gen)

    def _recover(self, old: _Generation | None) -> _Generation:
        """Probe the master with ``is_exist`` (through the old client) and set up a new client."""
        if old is not None:
            try:
                old.client.is_exist(PROBE_KEY)  # raises (or blocks, and is abandoned) while the master is down
            finally:
                self._leave(old)
        # A setup stuck on a hung master must not hold every later probe's thread.
        if not self._setup_lock.acquire(timeout=self.timeout_s):
            raise MooncakeUnavailable("a client setup is still running", RPC_FAIL)
        try:
            with self._lock:
                cur = self._gen
                if cur is not None and cur is not old and not self._down:
                    cur.users += 1
                    return cur  # another probe recovered meanwhile
            client = MooncakeClient.open(self._settings, self._regions)
            retired: MooncakeClient | None = None
            with self._lock:
                if self._closed:
                    retired, gen = client, None
                else:
                    prev = self._gen
                    gen = self._gen = _Generation(client)
                    gen.users += 1
                    self.setups += 1
                    if prev is not None:
                        self.last_recovery_s = time.monotonic() - self._down_since
                        prev.retired = True
                        if prev.users == 0:
                            retired = prev.client
                    self._down = False
            if retired is not None:
                retired.close()
            if gen is None:
                raise MooncakeUnavailable("call after close", RPC_FAIL)
            if old is not None:
                logger.info("mooncake tier: the store answers again; a new client is set up")
            return gen
        finally:
            self._setup_lock.release()

    def _leave(self, gen: _Generation) -> None:
        with self._lock:
            gen.users -= 1
            done = gen.users == 0 and (gen.retired or self._closed)
        if done:
            gen.client.close()

    def _job(self, fn: Callable[..., T], args: tuple[Any, ...], probe: bool) -> T:
        gen = self._enter(probe)
        try:
            return fn(gen.client, *args)
        except MooncakeUnavailable as exc:
            self.mark_down(str(exc))
            raise
        finally:
            self._leave(gen)

    # ---- on the loop -------------------------------------------------------------------------------
    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        n: int = 1,
        orphan: Callable[[T], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn(client, *args)`` on a worker thread within the timeout (one per 64 of the
        ``n`` entries of a batch); :class:`MooncakeTimeout` when it did not finish in time.

        ``orphan`` receives a result nobody awaits any more; ``after`` runs once the job is
        over however it ended (also when it never ran). Refused at once (raising
        :class:`MooncakeUnavailable`) while the store is down and no probe is due, or while
        as many abandoned jobs run as there are threads."""
        probe = 0
        try:
            with self._lock:
                if self._closed:
                    raise MooncakeUnavailable("call after close", RPC_FAIL)
                if self._abandoned >= self.workers:
                    self.refused += 1
                    raise MooncakeUnavailable(f"{self._abandoned} timed-out calls still running", RPC_FAIL)
                if self._down or self._gen is None:
                    now = time.monotonic()
                    # A probe stuck longer than the timeout is abandoned: the next one may go.
                    running = self._probe is not None and now - self._probe[1] < self.timeout_s
                    if running or now < self._next_probe:
                        self.refused += 1
                        raise MooncakeUnavailable("store unreachable; waiting for the next probe", RPC_FAIL)
                    self._probe_token += 1
                    probe = self._probe_token
                    self._probe = (probe, now)
                    self._next_probe = now + PROBE_INTERVAL_S
            cf = self._executor.submit(self._job, fn, args, bool(probe))
        except BaseException:
            if probe:
                self._probe_done(probe)
            if after is not None:
                after()
            raise
        if probe:
            token = probe
            cf.add_done_callback(lambda _f: self._probe_done(token))
        if after is not None:
            cf.add_done_callback(lambda _f: after())
        timeout = self.timeout_s * max(1, -(-n // _ENTRIES_PER_TIMEOUT))
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.wrap_future(cf)
        except TimeoutError:
            self._abandon(cf, orphan)
            self.mark_down(f"a call took longer than {timeout}s")
            raise MooncakeTimeout(f"mooncake call did not finish within {timeout}s") from None
        except asyncio.CancelledError:
            self._abandon(cf, orphan)
            if time.monotonic() - started >= 0.9 * timeout:  # the manager's own timeout fired
                self.mark_down(f"a call took longer than {timeout}s")
            raise

    def _probe_done(self, token: int) -> None:
        with self._lock:
            if self._probe is not None and self._probe[0] == token:
                self._probe = None

    def _abandon(self, cf: concurrent.futures.Future[T], orphan: Callable[[T], None] | None) -> None:
        if orphan is not None:
            cf.add_done_callback(lambda f: _give_orphan(f, orphan))
        if cf.done():
            return
        with self._lock:
            self._abandoned += 1
            self.abandoned_calls += 1

        def finished(_f: object) -> None:
            with self._lock:
                self._abandoned -= 1

        cf.add_done_callback(finished)

    async def close(self) -> None:
        """Refuse new jobs and close the client; a client still used by an abandoned job is
        closed by that job when it ends. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            gen = self._gen
            idle = gen is not None and gen.users == 0
        self._executor.shutdown(wait=False, cancel_futures=True)
        if gen is not None and idle:
            await asyncio.get_running_loop().run_in_executor(None, gen.client.close)


def _give_orphan(f: concurrent.futures.Future[T], orphan: Callable[[T], None]) -> None:
    if f.cancelled() or f.exception() is not None:
        return
    try:
        orphan(f.result())
    except Exception:  # pragma: no cover - a release that fails must not kill the worker
        logger.debug("releasing an abandoned mooncake result failed", exc_info=True)
