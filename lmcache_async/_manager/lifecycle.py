"""A manager's lifecycle: starting its tiers, opening without blocking a loop, closing.

:class:`Lifecycle` is a part a :class:`~lmcache_async.storage_manager.StorageManager` owns,
built last from the parts before it and handed each of them explicitly (it never sees the
manager). It holds the closed state, starts the tiers (blocking, or awaited through
:class:`Opening`), closes in order — refuse new work, flush write-through (bounded), close the
tiers, stop the loop, join its thread (bounded), release the pools — is tracked by
:mod:`lmcache_async.at_exit` (closed at interpreter exit), and closes a manager collected unclosed
with a ``ResourceWarning``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import warnings
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from lmcache_async import at_exit
from lmcache_async._manager.lower_tiers import LowerTiers
from lmcache_async._manager.staging import StagingArea
from lmcache_async._manager.write_through import WriteThrough
from lmcache_async.errors import LoopThreadCallError
from lmcache_async.loop import LoopThread
from lmcache_async.memory import PoolAllocator
from lmcache_async.tiers import PoolTier

__all__ = ["CLOSE_FLUSH_S", "START_TIMEOUT_FLOOR_S", "ClosedByLifecycle", "Detachable", "Lifecycle", "Opening"]

logger = logging.getLogger(__name__)

#: Tiers get at least this long to start (a remote store's first connection, a disk rebuild).
START_TIMEOUT_FLOOR_S = 30.0
#: Flush bound of a close that names none.
CLOSE_FLUSH_S = 10.0
#: Flush bound of a manager closed by the garbage collector.
_GC_FLUSH_S = 2.0


class Detachable(Protocol):
    """A part that lets go of the tiers and pools it holds once the manager closed."""

    def detach(self) -> None: ...


class Lifecycle:
    """Start and close of the manager named ``name``, over its parts: the loop thread ``lt``, the
    I/O ``executor``, the lower tiers ``tiers``, the write-through ``wt``, the CPU pool tier
    ``cpu`` and ``pool``, the ``staging`` area, and the ``parts`` to detach on release.
    ``timeout`` is the manager's ``blocking_timeout_secs``. Tracked for interpreter exit from
    construction on.

    :attr:`closed` is False from construction until a close (or a failed start) begins.
    Threads: :meth:`close_sync` from any thread but the loop's; :meth:`close_async` from any
    event loop, the manager's own included. Both are idempotent and never raise for storage
    trouble (a shutdown that does not finish is logged)."""

    def __init__(
        self,
        name: str,
        timeout: float,
        lt: LoopThread,
        executor: concurrent.futures.ThreadPoolExecutor,
        tiers: LowerTiers,
        wt: WriteThrough,
        *,
        cpu: PoolTier | None,
        pool: PoolAllocator | None,
        staging: StagingArea,
        parts: Sequence[Detachable],
    ) -> None:
        self.name = name
        self._timeout = timeout
        self._lt = lt
        self._executor = executor
        self._tiers = tiers
        self._wt = wt
        self._cpu = cpu
        self._pool = pool
        self._staging = staging
        self._parts = tuple(parts)
        self._close_lock = threading.Lock()
        self.closed = False
        at_exit.close_at_exit(self)

    def _release(self) -> None:
        """Close the pool tier and let every part drop its references to the pools and tiers:
        their memory goes as soon as callers release what they still hold."""
        if self._cpu is not None:
            self._cpu.close_nowait()
        if self._pool is not None and self._pool.used_bytes:
            logger.warning(
                "StorageManager %r closed while callers hold %d bytes of its pool; the pool is "
                "released once they drop their references",
                self.name,
                self._pool.used_bytes,
            )
        for pool in (self._pool, self._staging.pool):
            if pool is not None:  # its pre-touch thread holds it: stop that first
                pool.stop_pretouch()
        for part in self._parts:
            part.detach()
        self._cpu = self._pool = self._staging.pool = None
        self._parts = ()

    # ---- start ----------------------------------------------------------------------------------
    def _start_timeout(self) -> float:
        return max(self._timeout, START_TIMEOUT_FLOOR_S)

    def start_sync(self) -> None:
        """Start every lower tier on the loop, blocking this thread (bounded); on failure stop
        everything and raise."""
        try:
            self._lt.run_sync(self._tiers.start(), timeout=self._start_timeout())
        except BaseException:
            self.abort_start()
            raise

    async def start_async(self) -> None:
        """:meth:`start_sync` awaited from any event loop (the abort runs on a worker thread)."""
        try:
            async with asyncio.timeout(self._start_timeout()):
                await self._lt.run_async(self._tiers.start())
        except BaseException:
            await asyncio.to_thread(self.abort_start)
            raise

    def abort_start(self) -> None:
        """Undo a start that failed: close what was built, stop the loop. Blocking, bounded."""
        self.closed = True
        at_exit.forget(self)
        if self._tiers.guards and not self._lt.closed and not self._lt.in_loop_thread():
            try:
                self._lt.run_sync(self._tiers.close(), timeout=START_TIMEOUT_FLOOR_S)
            except Exception:
                logger.warning("StorageManager %r: tiers did not close after a failed start", self.name)
        self._lt.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def abort_start_soon(self) -> None:
        """:meth:`abort_start` on a thread of its own (for a callback that must not block);
        :attr:`closed` at once."""
        self.closed = True
        threading.Thread(target=self.abort_start, name="lmcache-async-abort-open", daemon=True).start()

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
            self.closed = True
            return False
        with self._close_lock:
            if self.closed:
                return False
            self.closed = True
        at_exit.forget(self)
        return True

    def _finish_close(self) -> None:
        self._lt.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._wt.close()  # a shutdown that timed out, or writes queued after it
        self._release()

    def close_sync(self, flush_timeout: float = CLOSE_FLUSH_S, grace: float = START_TIMEOUT_FLOOR_S) -> None:
        """Close from a thread without the loop; waits at most ``flush_timeout + grace``.
        Raises :class:`LoopThreadCallError` on the loop thread (unless already closed)."""
        if self.closed:
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

    async def close_async(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """Close from any event loop. On the manager's own loop it shuts down there and stops
        the loop once the awaiting task has moved on (joining its own thread would deadlock)."""
        if not self._begin_close():
            return
        if self._lt.in_loop_thread():
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

    def collected(self, source: object) -> None:
        """The manager ``source`` is being garbage-collected: close it unless it is closed
        (bounded), then warn (``ResourceWarning``). The warning comes last because it may raise
        (warnings as errors) and must not skip the cleanup. Never raises otherwise."""
        if self.closed:
            return
        if self._lt.in_forked_child():
            self.closed = True
            return
        try:
            if self._lt.in_loop_thread():
                if self._begin_close():
                    self._lt.loop.call_soon(self._finish_close)
            else:
                self.close_sync(_GC_FLUSH_S, grace=1.0)
        except Exception:  # pragma: no cover - a finalizer must not raise
            logger.debug("closing an unclosed StorageManager %r failed", self.name, exc_info=True)
        warnings.warn(
            f"StorageManager {self.name!r} was garbage-collected unclosed; it was closed then, its "
            f"pending writes given {_GC_FLUSH_S:.0f}s. Close it: close_sync(), aclose(), or a with block.",
            ResourceWarning,
            stacklevel=1,
            source=source,
        )


class ClosedByLifecycle:
    """The closing half of a manager's public surface, written once over its :class:`Lifecycle`:
    ``close_sync``/``close``/``aclose``, ``with`` and ``async with`` blocks, the ``closed`` flag,
    and closing (with a ``ResourceWarning``) when collected unclosed.

    A subclass sets ``_life`` when it is built (never before: an object that failed to build
    closes nothing) and overrides :meth:`_let_go` to drop its own references once closed.
    """

    _life: Lifecycle

    @property
    def closed(self) -> bool:
        """True once :meth:`close` started."""
        return self._life.closed

    def close_sync(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """Refuse new work, flush pending writes (bounded), close the tiers and stop the loop.

        Idempotent. Raises :class:`LoopThreadCallError` on the loop thread."""
        self._life.close_sync(flush_timeout)
        self._let_go()

    async def close(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """Async twin of :meth:`close_sync`, awaitable from any loop. Awaited on the manager's own loop thread it
        closes everything and returns without raising; that loop stops once the awaiting task next yields, so nothing
        else should be left to run there."""
        await self._life.close_async(flush_timeout)
        self._let_go()

    async def aclose(self, flush_timeout: float = CLOSE_FLUSH_S) -> None:
        """The same as :meth:`close` (the name async resources use)."""
        await self.close(flush_timeout)

    def _let_go(self) -> None:
        """Once closed, drop this object's own references to tiers and pools (default: nothing)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_sync()

    def __del__(self) -> None:
        # Never closed: the lifecycle closes it (bounded), then warns; nothing when never built or closed.
        life = self.__dict__.get("_life")
        if life is not None:
            life.collected(self)


class _AsyncClosable(Protocol):
    async def aclose(self, flush_timeout: float = ...) -> None: ...


M = TypeVar("M", bound=_AsyncClosable)


class Opening(Generic[M]):
    """What :meth:`StorageManager.open` returns: await it for a started manager, or use it as
    ``async with`` (the manager is closed on exit). ``build`` makes the manager with its tiers
    unstarted and returns it with its :class:`Lifecycle`; it runs on a worker thread (pool
    allocation may take a while). Single use."""

    def __init__(self, build: Callable[[], tuple[M, Lifecycle]]) -> None:
        self._build = build
        self._manager: M | None = None

    async def _open(self) -> M:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, self._build)
        try:
            sm, life = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The build goes on without us: whatever it makes is closed, off this loop.
            fut.add_done_callback(_abort_built)
            raise
        await life.start_async()
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
            await self._manager.aclose(CLOSE_FLUSH_S)


def _abort_built(fut: asyncio.Future[tuple[Any, Lifecycle]]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result()[1].abort_start_soon()
