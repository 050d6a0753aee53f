"""Large engine copies off the caller's event loop; small ones stay on it.

An engine coroutine whose work the CPU tier answers runs on the caller's thread: no hop. A copy
is a blocking call, though, and a long one freezes the caller's loop (an HS retrieve of 16k
tokens x 4,096 float32 copies 256 MiB, ~150 ms here). Above :data:`OFF_LOOP_COPY_BYTES` the
copy runs on a small engine-wide executor while the loop keeps serving; below it the hop would
cost more than the loop time it frees.

The job handed to :func:`run_off_loop` owns whatever it holds (pool references): it releases
them itself, on every path, so a caller cancelled while the job runs leaks nothing — the job
runs to its end and its result is dropped.

Only an *awaited* operation leaves its loop. The same coroutine stepped by its blocking twin
(:func:`~lmcache_async.engines._twins.blocking_twin`, through :meth:`SyncBridge.run`) has no
loop to keep serving: :func:`should_offload` is then False (every copy runs inline on the
caller's thread, as a blocking call always did) and :func:`yield_to_loop` does nothing.
The engines call ``_offload.run_off_loop`` through this module, so one patch intercepts them all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import types
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from lmcache_async.sync_bridge import stepped_by_bridge

T = TypeVar("T")

OFF_LOOP_COPY_BYTES = 8 << 20
"""Copies of at least this many bytes leave the caller's loop.

Measured, not guessed: the off-loop path must cost at most ~1.2x the inline one, so the hop
may be at most 20% of the copy. ``lmcache-async bench --suite kv_hs`` prints both ("off-loop
copy threshold": the copy-executor round trip beside a rotating 1 MiB ``copy_``): on the 2-vCPU
reference host a round trip costs about as much as 1.4 MiB of copy (~100 µs against ~70 µs per
MiB), which puts the 20% point at ~7 MiB; 8 MiB freezes the caller's loop for at most ~0.6 ms.
Under heavy load both figures grow (0.5-0.8 ms per hop, 7-17 ms per MiB measured with the host
16x oversubscribed), which only moves the 20% point lower: 8 MiB stays on the safe side.
"""

COPY_WORKERS = 1
"""Threads of the copy executor. One: a copy is memory-bound and torch already spreads one large
copy over its intra-op threads; every extra calling thread would bring its own OpenMP team to
compete with the caller's for the same cores."""

_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def should_offload(nbytes: int, *, force: bool = False) -> bool:
    """True when a copy of ``nbytes`` bytes (any size when ``force``) should run off the caller's
    loop: the running operation is awaited on an event loop and the copy is large. Always False
    while a blocking twin steps the operation (:func:`stepped_by_bridge`): the copy then runs
    inline on the caller's thread."""
    return (force or nbytes >= OFF_LOOP_COPY_BYTES) and not stepped_by_bridge()


def _copy_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    ex = _executor
    if ex is None:
        with _lock:
            ex = _executor
            if ex is None:
                ex = _executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=COPY_WORKERS, thread_name_prefix="lmcache-async-engine-copy"
                )
    return ex


def _forget_executor() -> None:  # in a forked child: the parent's threads do not exist there
    global _executor
    _executor = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_executor)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: an abandoned job's error is not logged as "never retrieved"


async def run_off_loop(fn: Callable[[], T]) -> T:
    """``fn()`` on the copy executor, awaited from the caller's loop.

    ``fn`` must release what it holds on every path: a cancelled caller does not stop it (the
    job runs to its end, its result is dropped), so nothing it holds leaks. When the executor
    is gone (interpreter exit) ``fn`` runs inline.
    """
    try:
        cf = _copy_executor().submit(fn)
    except RuntimeError:  # shut down at interpreter exit
        return fn()
    fut = asyncio.wrap_future(cf)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_consume)
        raise


async def copy_maybe_off_loop(fn: Callable[[], T], nbytes: int, *, force: bool = False) -> T:
    """:func:`run_off_loop` when :func:`should_offload` says so (awaited, and ``nbytes`` at
    least the threshold or ``force``), else ``fn()`` inline on the caller's thread. Same
    ownership rule as :func:`run_off_loop`."""
    if should_offload(nbytes, force=force):
        return await run_off_loop(fn)
    return fn()


@types.coroutine
def yield_to_loop() -> Generator[None, None, None]:
    """Give the caller's event loop one turn: what ``await asyncio.sleep(0)`` does (a bare
    ``yield`` to the task, which the loop schedules again at once), without the two coroutine
    frames around it (measured here: 1.8 µs instead of 2.3 µs per turn in a warm loop).

    An engine coroutine the CPU tier answers completes without ever suspending; a task calling
    such coroutines in a loop would then hold its event loop until it reached one that does,
    and every other task of that loop — one waiting for a lower-tier answer among them — would
    wait with it (measured: an awaited encoder-cache get behind 31 such tasks waited 50 s). Each
    public engine coroutine therefore yields once, as cooperative code should. Only for
    coroutines run by an asyncio task or stepped by a blocking twin; in the latter (no loop to
    give a turn to, :func:`stepped_by_bridge`) it does nothing.
    """
    if not stepped_by_bridge():
        yield
