"""Growing the namespace pools of the node cache server in the background.

A pool's memfd is sparse at its full size (:class:`~lmcache_async.server.shm.SharedPool`); only a
committed prefix is allocatable. :class:`PoolGrowth` commits the next step when a pool's free
committed room falls below half a step (and at once for a new pool): it checks the step against
available memory first (one log line, rate-limited, when a pool cannot grow; the pool then evicts
within what it has and a later step is tried again after :data:`RETRY_S`), allocates the step's
pages on its own worker thread, then hands the step to the allocator on the loop.

Thread affinity: every method runs on the server's event loop; the blocking work runs on one
worker thread shared by all pools (steps of different pools run one after another). Nothing here
blocks the loop; a grant that finds no room waits for a step in flight, bounded by its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from lmcache_async.memory import GiB, memory_available_bytes, memory_total_bytes
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.server.shm import SharedPool

__all__ = ["RETRY_S", "WAIT_S", "PoolGrowth", "check_pool_size", "default_reserve_bytes", "memory_total_bytes"]

logger = logging.getLogger(__name__)

#: After a step was refused for lack of memory, the next try waits this long (seconds).
RETRY_S = 10.0
#: Longest a grant waits for a step in flight before it is refused (below a client's default
#: call timeout of 2 s).
WAIT_S = 1.0


def default_reserve_bytes() -> int:
    """Memory kept free beside the pools when no ``memory_reserve_size`` is configured: 5 % of
    what is available, at least 0.5 GiB, at most 2 GiB (the CPU tier's rule)."""
    return min(2 * GiB, max(GiB // 2, (memory_available_bytes() or 0) // 20))


def check_pool_size(pool_bytes: int, reserve_bytes: int | None = None) -> None:
    """``ValueError`` (one line, naming ``max_local_cpu_size``) when a namespace pool of
    ``pool_bytes`` can never fit: it exceeds the machine's memory less the reserve. A pool that
    fits the machine but not what is free now is fine: it is committed as it fills."""
    total = memory_total_bytes()
    if total is None:
        return
    reserve = default_reserve_bytes() if reserve_bytes is None else reserve_bytes
    if pool_bytes > total - reserve:
        raise ValueError(
            f"max_local_cpu_size is {pool_bytes / GiB:.2f} GiB: a namespace pool that large can never fit in this "
            f"machine's {total / GiB:.2f} GiB of memory ({reserve / GiB:.2f} GiB kept in reserve); lower it"
        )


class PoolGrowth:
    """Commits namespace pools step by step in the background; see the module docstring."""

    def __init__(self, reserve_bytes: int | None = None) -> None:
        self.reserve_bytes = reserve_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[int, asyncio.Future[bool]] = {}
        self._retry_at: dict[int, float] = {}
        self._log = RateLimitedLog(logger)
        #: Steps committed, and steps refused for lack of memory (or failed), over all pools.
        self.steps = 0
        self.refused = 0

    def short(self, pool: SharedPool) -> bool:
        """Whether ``pool`` is below its low-water mark (free committed room under half a step)
        and may still grow: a grant there may have to wait for a step."""
        return pool.committed < pool.capacity and pool.committed - pool.used_bytes < max(pool.next_step(), 1) // 2

    def maybe_grow(self, pool: SharedPool) -> asyncio.Future[bool] | None:
        """Start the next step of ``pool`` when it is short of room (see :meth:`short`); the
        step in flight (started now or before), or None when none runs."""
        fut = self._inflight.get(id(pool))
        if fut is not None or not self.short(pool):
            return fut
        return self._start(pool)

    def _start(self, pool: SharedPool) -> asyncio.Future[bool] | None:
        if pool.committed >= pool.capacity or pool.fd < 0:
            return None
        if pool.grow_refused:
            if time.monotonic() < self._retry_at.get(id(pool), 0.0):
                return None
            pool.grow_refused = False  # try again: memory may have been freed meanwhile
        fut = asyncio.ensure_future(self._grow(pool))
        self._inflight[id(pool)] = fut
        fut.add_done_callback(lambda _f: self._inflight.pop(id(pool), None))
        return fut

    async def _grow(self, pool: SharedPool) -> bool:
        step = pool.next_step()
        why = self._memory_short(step)
        if why is None:
            offset = pool.committed
            fd = os.dup(pool.fd)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="lmcache-async-pool-growth")
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, pool.prepare, fd, offset, step)
            except OSError as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if pool.fd >= 0 and pool.committed == offset:
                    pool.commit_more(step)
                    self.steps += 1
                return True
        self.refused += 1
        pool.grow_refused = True
        self._retry_at[id(pool)] = time.monotonic() + RETRY_S
        self._log.warning(
            "cache server: pool %s cannot grow past %.2f GiB (of %.2f GiB): %s; it evicts within what it has "
            "(free memory, or lower max_local_cpu_size)",
            pool.name, pool.committed / GiB, pool.capacity / GiB, why, key=f"grow-{pool.name}",
        )  # fmt: skip
        return False

    def _memory_short(self, step: int) -> str | None:
        """Why ``step`` more bytes do not fit beside the reserve now (None: they fit, or
        available memory cannot be read)."""
        avail = memory_available_bytes()
        if avail is None:
            return None
        reserve = default_reserve_bytes() if self.reserve_bytes is None else self.reserve_bytes
        if step > avail - reserve:
            return (
                f"a step of {step / GiB:.2f} GiB does not fit in {avail / GiB:.2f} GiB available "
                f"with {reserve / GiB:.2f} GiB kept in reserve"
            )
        return None

    async def wait_room(self, pool: SharedPool, deadline: float) -> bool:
        """Wait (until ``deadline``, loop time) for the next step of ``pool`` to be committed,
        starting it if none runs: True when a step landed, False when the pool cannot grow
        (fully committed, refused) or the deadline passed."""
        fut = self._inflight.get(id(pool)) or self._start(pool)
        if fut is None:
            return False
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        try:
            return await asyncio.wait_for(asyncio.shield(fut), left)
        except TimeoutError:
            return False

    def close(self) -> None:
        """Cancel steps in flight (a step already on the worker thread finishes there; its
        descriptor is its own) and let the worker thread go."""
        for fut in list(self._inflight.values()):
            fut.cancel()
        if self._executor is not None:
            with contextlib.suppress(Exception):
                self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
