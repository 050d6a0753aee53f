"""The event-loop thread and the bridges to it.

Each :class:`LoopThread` runs one asyncio loop on a daemon thread named
``lmcache-async-<name>``. Other threads reach it through:

* :meth:`LoopThread.run_sync` — submit a coroutine and wait (bounded). It raises
  :class:`LoopThreadCallError` at once on the loop thread itself (it would deadlock),
  :class:`ManagerClosedError` after :meth:`stop`, :class:`ForkedProcessError` in a forked
  child, and ``TimeoutError`` after cancelling the coroutine when the timeout passes;
* :meth:`LoopThread.run_async` — await a coroutine on this loop from any other event loop
  (``asyncio.wrap_future``), or directly when already on this loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from lmcache_async.errors import ForkedProcessError, LoopThreadCallError, ManagerClosedError

__all__ = ["LoopThread", "wait_future"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_live_loops: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_NOTHING: Any = object()
_WAIT_SLICE_S = 0.25


def _after_fork_in_child() -> None:
    for lt in list(_live_loops):
        lt._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_coro(coro: object) -> None:
    close = getattr(coro, "close", None)
    if close is not None:
        close()


class LoopThread:
    """An asyncio loop running forever on its own named daemon thread."""

    def __init__(self, name: str, *, start_timeout: float = 10.0) -> None:
        self.name = f"lmcache-async-{name}"
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._on_loop_exception)
        self._pid = os.getpid()
        self._forked = False
        self._stopped = False
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()
        if not self._ready.wait(start_timeout):  # pragma: no cover - pathological
            raise RuntimeError(f"{self.name}: loop thread did not start")
        self.thread_id = self.thread.ident
        _live_loops.add(self)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            except Exception:  # pragma: no cover - best effort
                logger.debug("%s: error while draining the loop", self.name, exc_info=True)
            finally:
                self.loop.close()

    def _on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # A failing task must never take the loop down; log it and go on.
        exc = context.get("exception")
        logger.error("%s: unhandled error in loop: %s", self.name, context.get("message"), exc_info=exc)

    # ---- state ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopped

    def in_loop_thread(self) -> bool:
        """True when called from this loop's own thread."""
        return threading.get_ident() == self.thread_id

    def usable_from_here(self) -> bool:
        """True when this thread may wait on the loop: not the loop's own, not a forked child,
        not stopped (one identity check and two flags: a fast path's guard)."""
        return threading.get_ident() != self.thread_id and not self._forked and not self._stopped

    def in_forked_child(self) -> bool:
        """True in a process forked after this loop was created (the loop is not usable there)."""
        return self._forked or os.getpid() != self._pid

    def check_usable(self) -> None:
        """Raise the named misuse error if the loop cannot take work from this process.

        ``_forked`` is set in a child by the at-fork hook, so the hot path needs no ``getpid``."""
        if self._forked:
            self._forked = True
            raise ForkedProcessError(
                f"{self.name} was created in process {self._pid}; it cannot be used after fork(). "
                "Create a new manager/engine in the child process."
            )
        if self._stopped:
            raise ManagerClosedError(f"{self.name} is closed")

    # ---- bridges -------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a concurrent future. Never blocks."""
        try:
            self.check_usable()
        except BaseException:
            _close_coro(coro)
            raise
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(
        self, coro: Coroutine[Any, Any, T], timeout: float | None, orphan: Callable[[T], None] | None = None
    ) -> T:
        """Run ``coro`` on the loop and wait for its result from a thread without a loop.

        Raises :class:`LoopThreadCallError` on the loop thread, ``TimeoutError`` (after
        cancelling the coroutine) when ``timeout`` seconds pass, :class:`ManagerClosedError` when
        the loop stops while the call is in flight. A result the coroutine still produces after
        the caller gave up is handed to ``orphan`` exactly once (so owned buffers are released).
        """
        if self.in_loop_thread():
            _close_coro(coro)
            raise LoopThreadCallError(
                f"a blocking call was made on {self.name}'s own loop thread; await the async method instead"
            )
        if orphan is None:
            return wait_future(self.submit(coro), timeout, self.name)
        lock = threading.Lock()
        cell: dict[str, Any] = {}

        async def guarded() -> T:
            result = await coro
            with lock:
                give_back = cell.get("abandoned", False)
                if not give_back:
                    cell["result"] = result
            if give_back:
                orphan(result)
            return result

        fut = self.submit(guarded())
        try:
            return wait_future(fut, timeout, self.name)
        except BaseException:
            with lock:
                cell["abandoned"] = True
                left = cell.pop("result", _NOTHING)
            if left is not _NOTHING:
                orphan(left)
            raise

    async def run_async(self, coro: Coroutine[Any, Any, T], orphan: Callable[[T], None] | None = None) -> T:
        """Await ``coro`` on this loop from whatever loop the caller runs on.

        Two thread crossings and no intermediate concurrent future. When the awaiting task is
        cancelled the coroutine is cancelled too; a result it still produces after the caller
        gave up is handed to ``orphan`` (so owned buffers can be released).
        """
        running = asyncio.get_running_loop()
        if running is self.loop:
            return await coro
        try:
            self.check_usable()
        except BaseException:
            _close_coro(coro)
            raise
        fut: asyncio.Future[T] = running.create_future()
        state: dict[str, Any] = {}

        def settle(task: asyncio.Task[T]) -> None:  # on the caller's loop
            if fut.done():
                if orphan is not None and not task.cancelled() and task.exception() is None:
                    orphan(task.result())
                return
            if task.cancelled():
                if state.get("cancelled"):
                    fut.cancel()
                else:  # cancelled by the loop stopping, not by the caller
                    fut.set_exception(ManagerClosedError(f"{self.name} closed while the call was in flight"))
            elif (exc := task.exception()) is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(task.result())

        def done(task: asyncio.Task[T]) -> None:  # on this loop
            try:
                running.call_soon_threadsafe(settle, task)
            except RuntimeError:  # the caller's loop is gone
                if orphan is not None and not task.cancelled() and task.exception() is None:
                    orphan(task.result())

        def start() -> None:  # on this loop
            if state.get("cancelled"):
                _close_coro(coro)
                return
            task = self.loop.create_task(coro)
            state["task"] = task
            task.add_done_callback(done)

        def cancel() -> None:  # on this loop, always after start()
            task = state.get("task")
            if task is not None:
                task.cancel()

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:
            _close_coro(coro)
            raise ManagerClosedError(f"{self.name} is closed") from None
        try:
            return await fut
        except asyncio.CancelledError:
            state["cancelled"] = True
            # The result may have been set in the same loop iteration as the cancellation
            # (settle ran before this task resumed): nobody will read it, so hand it back.
            if orphan is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
                orphan(fut.result())
            try:
                self.loop.call_soon_threadsafe(cancel)
            except RuntimeError:
                pass
            raise

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Thread-safe ``call_soon``; ignored once the loop has stopped."""
        if self._stopped or self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed concurrently
            pass

    # ---- lifecycle -------------------------------------------------------------------------
    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (bounded). Idempotent; no-op in a forked child."""
        if self._stopped:
            return
        self._stopped = True
        if self._forked or os.getpid() != self._pid:
            return
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # pragma: no cover
                pass
        if not self.in_loop_thread():
            self.thread.join(join_timeout)
            if self.thread.is_alive():  # pragma: no cover - a blocked loop
                logger.warning("%s: loop thread did not stop within %.1fs", self.name, join_timeout)


def wait_future(fut: concurrent.futures.Future[T], timeout: float | None, what: str) -> T:
    """Wait for ``fut`` in short slices (so Ctrl-C works); cancel it and raise on timeout."""
    remaining = timeout
    while True:
        step = _WAIT_SLICE_S if remaining is None else min(_WAIT_SLICE_S, max(remaining, 0.0))
        try:
            return fut.result(step)
        except concurrent.futures.CancelledError:
            raise ManagerClosedError(f"{what}: closed while the call was in flight") from None
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine itself raised TimeoutError
                return fut.result(0)
            if remaining is not None:
                remaining -= step
                if remaining <= 0:
                    fut.cancel()
                    raise TimeoutError(f"{what}: call did not finish within {timeout}s") from None
        except BaseException:
            if not fut.done():
                fut.cancel()
            raise
