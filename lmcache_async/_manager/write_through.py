"""The write-through queue: entries a put stored locally, on their way to the lower tiers.

Caller threads :meth:`~WriteThrough.enqueue` (a lock, a dict store, a deque append; the loop is
woken with ``call_soon_threadsafe`` only when no wake-up is pending, so a burst of puts costs
one hop). A batch of puts enqueues inside :meth:`~WriteThrough.deferred_wake`: the loop is woken
once, when the batch ends, not after its first entry (a wake-up hands the loop thread the GIL;
the caller then waits for it back before its next put). On the loop thread the queue is
drained into tasks that write batches to every lower
tier concurrently, each tier call through its :class:`~lmcache_async._manager.tier_guard.TierGuard`.
:meth:`~WriteThrough.flush` is the barrier.

Read-your-writes: :attr:`~WriteThrough.pending` maps every key whose write-through has not
finished to its buffer, so the manager answers ``get``/``contains`` for it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Final

from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.loop import LoopThread
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import UNKNOWN

__all__ = ["BATCH_BYTES", "BATCH_ITEMS", "WriteItem", "WriteThrough"]

#: A batch written to the tiers in one ``batched_put`` holds at most this many entries ...
BATCH_ITEMS: Final = 64
#: ... or this many payload bytes.
BATCH_BYTES: Final = 64 << 20

WriteItem = tuple[CacheEngineKey, MemoryObj, tuple[int, ...] | None]
"""(key, buffer carrying one reference owned by the queue, indexes of the target tiers; None:
every tier)."""


class WriteThrough:
    """The write-through queue of one manager, writing to ``tiers`` on ``loop_thread``.

    Threads: :meth:`enqueue` and :meth:`close` from any thread; :meth:`flush` and
    :meth:`shutdown` are coroutines of the loop thread (the manager hops there first). The
    queue owns one reference to every buffer it holds and gives it back once every target tier
    has the entry or failed on it, or when :meth:`close` drops what was never written.

    ``tiers`` is the manager's list of lower tiers, read at each batch (a target index refers to
    it); :meth:`close` lets go of it.
    """

    def __init__(self, loop_thread: LoopThread, tiers: Sequence[TierGuard]) -> None:
        self._lt = loop_thread
        self._loop = loop_thread.loop
        self._tiers = tiers
        self._queue: deque[WriteItem] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._wake_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._deferring = threading.local()
        #: Key -> buffer of every write-through not finished yet. Written only under this
        #: queue's lock; caller threads read it without one (one dict lookup, atomic).
        self.pending: dict[CacheEngineKey, MemoryObj] = {}

    def enqueue(
        self, key: CacheEngineKey, obj: MemoryObj, targets: tuple[int, ...] | None, only_if_new: bool = False
    ) -> bool:
        """Queue ``obj`` (carrying one reference the queue now owns) for the tiers ``targets``
        (indexes into ``tiers``; None: all). Any thread; never waits for the loop.

        False when nothing was queued (the caller keeps that reference): with ``only_if_new``
        when ``key`` is already pending, and always once :meth:`close` ran."""
        with self._lock:
            if self._closed or (only_if_new and key in self.pending):
                return False
            self.pending[key] = obj
            self._queue.append((key, obj, targets))
            wake = not self._wake_scheduled
            self._wake_scheduled = True
        if wake:
            if getattr(self._deferring, "depth", 0):
                self._deferring.wake = True  # this thread wakes the loop when its batch ends
            else:
                self._lt.call_soon(self._drain)
        return True

    @contextlib.contextmanager
    def deferred_wake(self) -> Iterator[None]:
        """Within the block, this thread's :meth:`enqueue` calls do not wake the loop; it is
        woken once on exit (also on an exception) when one of them would have. Entries queued
        meanwhile by other threads wait for that wake-up too: keep the block short (no I/O)."""
        local = self._deferring
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            yield
        finally:
            local.depth = depth
            if depth == 0 and getattr(local, "wake", False):
                local.wake = False
                self._lt.call_soon(self._drain)

    def _drain(self) -> None:
        """Move everything queued into one writing task (loop thread)."""
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
            self._wake_scheduled = False
        if not items:
            return
        if self._loop.is_closed():  # pragma: no cover - racing close
            self._release(items)
            return
        task = self._loop.create_task(self._write_through(items))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release(self, items: Sequence[WriteItem]) -> None:
        """Give back the queue's references of ``items`` and end their pending state (a key
        queued again meanwhile stays pending with its newer buffer)."""
        with self._lock:
            for key, obj, _ in items:
                if self.pending.get(key) is obj:
                    del self.pending[key]
        for _, obj, _ in items:
            obj.ref_count_down()

    async def _write_through(self, items: list[WriteItem]) -> None:
        try:
            batch: list[WriteItem] = []
            size = 0
            for item in items:
                batch.append(item)
                size += item[1].nbytes
                if len(batch) >= BATCH_ITEMS or size >= BATCH_BYTES:
                    await self._write_batch(batch)
                    batch, size = [], 0
            if batch:
                await self._write_batch(batch)
        finally:
            self._release(items)

    async def _write_batch(self, batch: list[WriteItem]) -> None:
        jobs = []
        for i, tier in enumerate(self._tiers):
            pairs = [(k, o) for k, o, targets in batch if targets is None or i in targets]
            if pairs:
                jobs.append(self._write_tier(tier, pairs))
        if jobs:
            await asyncio.gather(*jobs)

    @staticmethod
    async def _write_tier(tier: TierGuard, pairs: list[tuple[CacheEngineKey, MemoryObj]]) -> None:
        async with tier.write_slots:
            res = await tier.call("put", tier.backend.batched_put, pairs, n=len(pairs))
        if res is UNKNOWN:
            tier.write_failures += len(pairs)
            return
        ok = sum(1 for r in res if r)
        tier.writes += ok
        tier.write_failures += len(pairs) - ok

    async def flush(self) -> None:
        """Wait until everything queued so far has reached (or failed on) every target tier,
        including what is queued while waiting. Loop thread. Cancelling the wait (a caller's
        timeout) leaves the writes running."""
        while True:
            self._drain()
            tasks = list(self._tasks)
            if not tasks:
                with self._lock:
                    if not self._queue:
                        return
                continue
            # wait, not gather: a flush given up on (timeout, cancel) must not cancel the writes
            await asyncio.wait(tasks)

    async def shutdown(self, flush_timeout: float) -> bool:
        """Flush for at most ``flush_timeout`` seconds, cancel the writes still running, then
        :meth:`close`. False when the flush did not finish in time (the rest was dropped).
        Loop thread."""
        flushed = True
        try:
            async with asyncio.timeout(flush_timeout):
                await self.flush()
        except TimeoutError:
            flushed = False
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.close()
        return flushed

    def close(self) -> None:
        """Refuse further writes, give back what is still queued and let go of the tiers.
        Any thread; idempotent."""
        with self._lock:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
        self._release(left)
        self._tiers = ()

    def __len__(self) -> int:
        """Entries whose write-through has not finished."""
        return len(self.pending)
