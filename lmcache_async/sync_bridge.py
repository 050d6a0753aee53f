"""One operation, written once: a coroutine whose loop work is marked by ``await hop``.

A :class:`StorageManager` operation is one coroutine. Its caller-thread part (the local tiers,
the pending write-through map) runs inline; every piece of lower-tier work is awaited through a
:class:`Hop`, the only place it crosses to the manager's loop thread. :class:`SyncBridge` runs
that coroutine in two ways:

* awaited (:meth:`Hop.__await__` on an event loop): each hop is
  :meth:`LoopThread.run_async`, under ``asyncio.timeout``;
* driven from a thread without an event loop (:meth:`SyncBridge.run`, what every ``*_sync``
  twin made by :func:`sync_twin` calls): the coroutine is stepped by hand; an operation that
  needs no hop finishes in its first step with no event loop involved, and each hop is
  :meth:`LoopThread.run_sync`.

Both ways bound a hop by the same ``timeout`` (``blocking_timeout_secs`` unless the operation
passes its own) and deliver its outcome into the coroutine the same way: the result, or the
exception — ``TimeoutError`` after the loop-side coroutine was cancelled, :class:`ManagerClosedError`
when the loop stopped meanwhile — raised at the ``await``. So the operation maps errors once,
for both twins.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Concatenate, Final, Generic, ParamSpec, Protocol, TypeVar, cast

from lmcache_async.errors import LoopThreadCallError
from lmcache_async.loop import LoopThread
from lmcache_async.tiers.abc import UNKNOWN, CannotTell

__all__ = ["NOT_HERE", "Hop", "NotHere", "SyncBridge", "stepped_by_bridge", "sync_twin"]

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

_driving = threading.local()


def stepped_by_bridge() -> bool:
    """True while this thread is stepping an operation for :meth:`SyncBridge.run` (the call of a
    blocking twin): no event loop drives the running coroutine, so it must not await anything but
    a :class:`Hop` (an operation that would hand work to another thread of its own, such as a
    large copy, does it inline instead). False on an event loop and outside any operation."""
    return getattr(_driving, "on", False)


class Hop(Generic[T]):
    """Awaitable lower-tier work of an operation: ``coro`` run on the loop thread.

    ``orphan`` receives a result the coroutine still produces after the caller gave up
    (timeout, cancellation), so owned buffers are released; ``timeout`` (seconds, None: the
    bridge's bound) bounds the wait. Await a Hop only inside an operation run by a
    :class:`SyncBridge` or awaited on an event loop; await it once.
    """

    __slots__ = ("_bridge", "coro", "orphan", "timeout")

    def __init__(
        self,
        bridge: SyncBridge,
        coro: Coroutine[Any, Any, T],
        orphan: Callable[[T], None] | None,
        timeout: float | None,
    ) -> None:
        self._bridge = bridge
        self.coro = coro
        self.orphan = orphan
        self.timeout = timeout

    def __await__(self) -> Generator[Any, Any, T]:
        if getattr(_driving, "on", False):
            # Stepped by SyncBridge.run on this thread: it runs the hop and sends the result in.
            result: T = yield self
            return result
        return (yield from self._bridge.hop_async(self).__await__())


class _HasBridge(Protocol):
    @property
    def bridge(self) -> SyncBridge: ...


class SyncBridge:
    """Runs operations of one manager over its :class:`LoopThread` ``loop_thread``; every hop
    waits at most ``timeout`` seconds unless the operation gives its own bound.

    The operations check the manager's own state (closed, forked) in their first step;
    :meth:`run` refuses the loop thread (:class:`LoopThreadCallError`) before that step.
    """

    def __init__(self, loop_thread: LoopThread, timeout: float) -> None:
        self.loop_thread = loop_thread
        self.timeout = timeout

    def hop(
        self, coro: Coroutine[Any, Any, T], orphan: Callable[[T], None] | None = None, timeout: float | None = None
    ) -> Hop[T]:
        """Mark ``coro`` as loop work of the running operation: ``return await bridge.hop(...)``."""
        return Hop(self, coro, orphan, timeout)

    def _bound(self, hop: Hop[Any]) -> float:
        return self.timeout if hop.timeout is None else hop.timeout

    async def hop_async(self, hop: Hop[T]) -> T:
        """The hop awaited on an event loop (the manager's own included), bounded."""
        async with asyncio.timeout(self._bound(hop)):
            return await self.loop_thread.run_async(hop.coro, hop.orphan)

    def run(self, op: Coroutine[Any, Any, T]) -> T:
        """Drive ``op`` to its result on this thread; hops wait on the loop (bounded).

        Raises :class:`LoopThreadCallError` on the manager's loop thread, and what ``op`` raises.
        """
        lt = self.loop_thread
        if lt.in_loop_thread():
            op.close()
            raise LoopThreadCallError(f"a *_sync call was made on {lt.name}'s loop thread; await the coroutine instead")
        send: Any = None
        error: BaseException | None = None
        driving = _driving
        outer = getattr(driving, "on", False)  # a sync run nested in another's step restores it
        while True:
            driving.on = True
            try:
                step = op.send(send) if error is None else op.throw(error)
            except StopIteration as stop:
                result: T = stop.value
                return result
            finally:
                driving.on = outer
            if not isinstance(step, Hop):
                op.close()
                raise TypeError(f"an operation awaited {type(step).__name__}, not a Hop, in a sync twin")
            try:
                send, error = lt.run_sync(step.coro, self._bound(step), step.orphan), None
            except BaseException as exc:  # delivered into the operation, which maps it
                send, error = None, exc


NotHere = CannotTell
NOT_HERE: Final = UNKNOWN
"""What a ``local`` answer of :func:`sync_twin` returns when it cannot answer by itself: the one
"cannot tell" sentinel, :data:`lmcache_async.tiers.UNKNOWN`."""


def sync_twin(
    op: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]],
    local: Callable[Concatenate[Any, P], R | CannotTell | Coroutine[Any, Any, R]] | None = None,
) -> Callable[Concatenate[_HasBridge, P], R]:
    """The blocking twin of the operation ``op`` (a coroutine method of an object with a
    ``bridge``): same arguments, same result, same errors, run by :meth:`SyncBridge.run`.

    ``local``, when given, is tried first with the same arguments: the operation's hot local
    answer (a CPU-tier hit) without building a coroutine. It must give exactly what ``op`` would
    give, or :data:`NOT_HERE` (then ``op`` runs), or a coroutine doing the rest of ``op``'s work
    after what ``local`` already did (then that runs instead, so the local part is not done
    twice); it must itself return :data:`NOT_HERE` for every call ``op`` would refuse (loop
    thread, closed, forked), so errors stay ``op``'s. (``op``'s results are never coroutines.)"""

    if local is None:

        @functools.wraps(op)
        def twin(self: _HasBridge, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return self.bridge.run(op(self, *args, **kwargs))

    else:
        here = local

        @functools.wraps(op)
        def twin(self: _HasBridge, /, *args: P.args, **kwargs: P.kwargs) -> R:
            r = here(self, *args, **kwargs)
            if r is NOT_HERE:
                return self.bridge.run(op(self, *args, **kwargs))
            if type(r) is types.CoroutineType:
                return cast(R, self.bridge.run(r))
            return cast(R, r)

    twin.__doc__ = (
        f"Blocking twin of :meth:`{op.__name__}` for threads without an event loop: the same "
        "result and errors; lower-tier work is bounded by ``blocking_timeout_secs``. Raises "
        ":class:`~lmcache_async.errors.LoopThreadCallError` on the manager's loop thread."
    )
    twin.__name__ = twin.__qualname__ = f"{op.__name__}_sync"
    return twin
