"""A manager's lifecycle: starting its tiers, opening without blocking a loop, closing.

:class:`Lifecycle` is the part of :class:`~lmcache_async.storage_manager.StorageManager` that
starts the tiers (blocking, or awaited through :class:`Opening`), closes in order — refuse new
work, flush write-through (bounded), close the tiers, stop the loop, join its thread (bounded),
release the pools — and warns (``ResourceWarning``) about a manager collected unclosed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import warnings
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from lmcache_async import at_exit
from lmcache_async.errors import LoopThreadCallError
from lmcache_async.front import Front
from lmcache_async.loop import LoopThread
from lmcache_async.lower_tiers import LowerTiers
from lmcache_async.memory import PoolAllocator
from lmcache_async.put_path import PutPath
from lmcache_async.read_into import ReadInto
from lmcache_async.staging import StagingArea
from lmcache_async.tier_guard import TierGuard
from lmcache_async.tiers import LocalTier, PoolTier
from lmcache_async.where import TierMap
from lmcache_async.write_through import WriteThrough

__all__ = ["CLOSE_FLUSH_S", "START_TIMEOUT_FLOOR_S", "Lifecycle", "Opening"]

logger = logging.getLogger(__name__)

#: Tiers get at least this long to start (a remote store's first connection, a disk rebuild).
START_TIMEOUT_FLOOR_S = 30.0
#: Flush bound of a close that names none.
CLOSE_FLUSH_S = 10.0
#: Flush bound of a manager closed by the garbage collector.
_GC_FLUSH_S = 2.0

M = TypeVar("M", bound="Lifecycle")


class Lifecycle:
    """Start and close of a manager; the attributes below are set by the manager's ``_build``.

    Threads: :meth:`_close_sync` from any thread but the loop's; :meth:`_close_async` from any
    event loop, the manager's own included. Both are idempotent and never raise for storage
    trouble (a shutdown that does not finish is logged)."""

    name: str
    _closed: bool
    _timeout: float
    _lt: LoopThread
    _executor: concurrent.futures.ThreadPoolExecutor
    _tiers: LowerTiers
    _wt: WriteThrough
    _close_lock: threading.Lock

    _front: Front
    _read_into: ReadInto
    _where: TierMap
    _cpu: PoolTier | None
    _local: Sequence[LocalTier]
    _lower: Sequence[TierGuard]
    _put: PutPath
    _staging: StagingArea
    pool: PoolAllocator | None
    staging_pool: PoolAllocator | None

    def _release_tiers(self) -> None:
        """Close the pool tier and drop every reference to the pools and tiers: their memory
        goes as soon as callers release what they still hold, even while this object lives on."""
        if self._cpu is not None:
            self._cpu.close_nowait()
        if self.pool is not None and self.pool.used_bytes:
            logger.warning(
                "StorageManager %r closed while callers hold %d bytes of its pool; the pool is "
                "released once they drop their references",
                self.name,
                self.pool.used_bytes,
            )
        self._cpu = None
        self._local = ()
        self._lower = ()
        self._front.detach()
        self._read_into.detach()
        self._where.detach()
        self._put.detach()
        self._tiers.detach()
        self.pool = None
        self.staging_pool = self._staging.pool = None

    # ---- start ----------------------------------------------------------------------------------
    def _start_timeout(self) -> float:
        return max(self._timeout, START_TIMEOUT_FLOOR_S)

    def _start_tiers_sync(self) -> None:
        """Start every lower tier on the loop, blocking this thread (bounded); on failure stop
        everything and raise."""
        try:
            self._lt.run_sync(self._tiers.start(), timeout=self._start_timeout())
        except BaseException:
            self._abort_start()
            raise

    async def _start_tiers_async(self) -> None:
        try:
            async with asyncio.timeout(self._start_timeout()):
                await self._lt.run_async(self._tiers.start())
        except BaseException:
            await asyncio.to_thread(self._abort_start)
            raise

    def _abort_start(self) -> None:
        """Undo a start that failed: close what was built, stop the loop. Blocking, bounded."""
        self._closed = True
        at_exit.forget(self)
        if self._tiers.guards and not self._lt.closed and not self._lt.in_loop_thread():
            try:
                self._lt.run_sync(self._tiers.close(), timeout=START_TIMEOUT_FLOOR_S)
            except Exception:
                logger.warning("StorageManager %r: tiers did not close after a failed start", self.name)
        self._lt.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- close ----------------------------------------------------------------------------------
    async def _shutdown(self, flush_timeout: float) -> None:
        if not await self._wt.shutdown(flush_timeout):
            logger.warning(
                "StorageManager %r: pending writes did not finish in %.1fs; dropped", self.name, flush_timeout
            )
        await self._tiers.close()

    def _begin_close(self) -> bool:
        if self._lt.in_forked_child():
            # Locks and threads of the parent are not ours: mark closed and touch nothing.
            self._closed = True
            return False
        with self._close_lock:
            if self._closed:
                return False
            self._closed = True
        at_exit.forget(self)
        return True

    def _finish_close(self) -> None:
        self._lt.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._wt.close()  # a shutdown that timed out, or writes queued after it
        self._release_tiers()

    def _close_sync(self, flush_timeout: float, grace: float = START_TIMEOUT_FLOOR_S) -> None:
        """Close from a thread without the loop; waits at most ``flush_timeout + grace``."""
        if self._closed:
            return
        if self._lt.in_loop_thread():
            raise LoopThreadCallError("close_sync() on the manager's loop thread; await close() instead")
        if not self._begin_close():
            return
        if not self._lt.closed:
            try:
                self._lt.submit(self._shutdown(flush_timeout)).result(flush_timeout + grace)
            except Exception:
                logger.warning("StorageManager %r: shutdown did not complete", self.name, exc_info=True)
        self._finish_close()

    async def _close_async(self, flush_timeout: float) -> None:
        if not self._begin_close():
            return
        if self._lt.in_loop_thread():
            # On our own loop: shut down here, then stop the loop once this task has moved on
            # (joining our own thread would deadlock; nothing here blocks).
            try:
                await self._shutdown(flush_timeout)
            finally:
                self._lt.loop.call_soon(self._finish_close)
            return
        if not self._lt.closed:
            try:
                await asyncio.wrap_future(self._lt.submit(self._shutdown(flush_timeout)))
            except Exception:
                logger.warning("StorageManager %r: shutdown did not complete", self.name, exc_info=True)
        await asyncio.to_thread(self._finish_close)

    def close_sync(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """Refuse new work, flush pending writes (bounded), close the tiers and stop the loop.

        Idempotent. Raises :class:`LoopThreadCallError` on the loop thread."""
        self._close_sync(flush_timeout)

    async def close(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """Async twin of :meth:`close_sync`, awaitable from any loop. Awaited on the manager's
        own loop thread it closes everything and returns without raising; that loop stops once
        the awaiting task next yields, so nothing else should be left to run there."""
        await self._close_async(flush_timeout)

    async def aclose(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """The same as :meth:`close` (the name async resources use)."""
        await self._close_async(flush_timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close_async(CLOSE_FLUSH_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_sync(CLOSE_FLUSH_S)

    def __del__(self) -> None:
        # A manager that was never closed: close it (bounded), then say so. The warning comes
        # last because it may raise (warnings as errors) and must not skip the cleanup.
        if getattr(self, "_closed", True) or not hasattr(self, "_lt"):
            return
        if self._lt.in_forked_child():
            self._closed = True
            return
        try:
            if self._lt.in_loop_thread():
                if self._begin_close():
                    self._lt.loop.call_soon(self._finish_close)
            else:
                self._close_sync(_GC_FLUSH_S, grace=1.0)
        except Exception:  # pragma: no cover - a finalizer must not raise
            logger.debug("closing an unclosed StorageManager %r failed", self.name, exc_info=True)
        warnings.warn(
            f"StorageManager {self.name!r} was garbage-collected unclosed; it was closed then, its "
            f"pending writes given {_GC_FLUSH_S:.0f}s. Close it: close_sync(), aclose(), or a with block.",
            ResourceWarning,
            stacklevel=1,
            source=self,
        )


class Opening(Generic[M]):
    """What :meth:`StorageManager.open` returns: await it for a started manager, or use it as
    ``async with`` (the manager is closed on exit). ``build`` makes the manager with its tiers
    unstarted; it runs on a worker thread (pool allocation may take a while). Single use."""

    def __init__(self, build: Callable[[], M]) -> None:
        self._build = build
        self._manager: M | None = None

    async def _open(self) -> M:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self._build)
        try:
            sm = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The build goes on without us: whatever it makes is closed, off this loop.
            fut.add_done_callback(_abort_built)
            raise
        await sm._start_tiers_async()
        return sm

    def __await__(self) -> Generator[Any, None, M]:
        return self._open().__await__()

    async def __aenter__(self) -> M:
        self._manager = await self._open()
        return self._manager

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._manager is not None:
            await self._manager._close_async(CLOSE_FLUSH_S)


def _abort_built(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        sm = fut.result()
        threading.Thread(target=sm._abort_start, name="lmcache-async-abort-open", daemon=True).start()
