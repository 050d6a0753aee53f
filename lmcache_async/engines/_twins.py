"""Engine operations written once, as coroutines; each blocking method is derived from one.

An engine operation is the coroutine ``a<name>``. Awaited on any event loop it gives that loop
one turn (:func:`~lmcache_async.engines._offload.yield_to_loop`), answers what the CPU tier
holds on the caller's thread, crosses to the manager's loop only for lower-tier work (each hop
bounded by ``blocking_timeout_secs``) and runs a copy of at least
:data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` on the engine copy executor.

Its blocking form ``<name>`` comes from :func:`blocking_twin`, exactly as the manager's
``*_sync`` twins come from :func:`~lmcache_async.sync_bridge.sync_twin`: the same coroutine,
stepped by the engine's :class:`~lmcache_async.sync_bridge.SyncBridge` on the caller's thread
(:meth:`SyncBridge.run`). There it yields nothing and copies inline (no executor hand-off,
:func:`~lmcache_async.sync_bridge.stepped_by_bridge`), a CPU-tier answer involves no loop at
all, and each lower-tier question is one bounded ``LoopThread.run_sync``, the hop the manager's
own ``*_sync`` call takes. So both forms give the same results, errors and counters by
construction; the blocking form raises
:class:`~lmcache_async.errors.LoopThreadCallError` on the bridge's loop thread before anything
runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from lmcache_async.sync_bridge import sync_twin

__all__ = ["blocking_twin"]

P = ParamSpec("P")
R = TypeVar("R")


def blocking_twin(op: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> Callable[Concatenate[Any, P], R]:
    """The blocking method of the engine coroutine method ``op`` (named ``a<name>``): same
    arguments, result and errors, run by ``self.bridge`` (a :class:`SyncBridge`) on the calling
    thread, which must not be that bridge's loop thread. Named ``<name>``; its docstring is
    ``op``'s, after a line saying so."""
    twin = sync_twin(op)
    name = op.__name__.removeprefix("a")
    owner, _, _ = op.__qualname__.rpartition(".")
    twin.__name__ = name
    twin.__qualname__ = f"{owner}.{name}" if owner else name
    twin.__doc__ = (
        f"Blocking form of :meth:`{op.__name__}` (same arguments, result and errors), for any thread "
        "but the manager's loop thread: the coroutine is stepped on the calling thread, every copy "
        "runs there, only lower-tier work waits on the manager's loop (bounded).\n\n"
        + inspect.cleandoc(op.__doc__ or "")
    )
    return twin
