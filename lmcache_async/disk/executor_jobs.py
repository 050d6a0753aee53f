"""Awaiting the disk tier's blocking executor jobs from the event loop.

The disk tier runs every file operation as a job on a :class:`concurrent.futures.Executor`;
this module is how its coroutines wait for them without leaking what a job allocated:
:func:`await_job` waits for one job, :func:`gather_jobs` for a batch with a single loop
wake-up. When the waiting coroutine is cancelled, a job that is still running keeps running and
its result is handed to an ``orphan`` callback once it finishes (so a buffer it filled is
released, never lost). :func:`release` and :func:`release_refs` are the callbacks the tier uses
for that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from lmcache_async.memory import MemoryObj

__all__ = ["await_job", "gather_jobs", "release", "release_refs"]

T = TypeVar("T")


async def await_job(cf: concurrent.futures.Future[T], orphan: Callable[[T], None] | None = None) -> T:
    """Await an executor job; if the caller is cancelled while the job runs, ``orphan``
    receives the job's result once it finishes (so buffers it allocated are released)."""
    try:
        return await asyncio.wrap_future(cf)
    except asyncio.CancelledError:
        if orphan is not None:
            cf.add_done_callback(functools.partial(_orphan_cb, orphan))
        raise


async def gather_jobs(
    cfs: Sequence[concurrent.futures.Future[T]], orphan: Callable[[T], None] | None = None
) -> list[T | BaseException]:
    """Await executor jobs with one loop wake-up for all of them; each job's result, or
    the exception it raised. On cancellation, jobs not yet started are cancelled and
    ``orphan`` receives the results of those still running once they finish."""
    if not cfs:
        return []
    loop = asyncio.get_running_loop()
    all_done: asyncio.Future[None] = loop.create_future()
    left = [len(cfs)]
    lock = threading.Lock()

    def one_done(_f: concurrent.futures.Future[T]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            try:
                loop.call_soon_threadsafe(_resolve, all_done)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    for cf in cfs:
        cf.add_done_callback(one_done)
    try:
        await all_done
    except asyncio.CancelledError:
        for cf in cfs:
            cf.cancel()
            if orphan is not None:
                cf.add_done_callback(functools.partial(_orphan_cb, orphan))
        raise
    out: list[T | BaseException] = []
    for cf in cfs:
        exc = cf.exception()
        out.append(exc if exc is not None else cf.result())
    return out


def release(obj: MemoryObj | None) -> None:
    """Drop the caller's reference to ``obj`` (an orphaned read's buffer; None: nothing)."""
    if obj is not None:
        obj.ref_count_down()


def release_refs(objs: list[MemoryObj], _f: object) -> None:
    """Done-callback of a write job: drop the references taken on ``objs`` for it."""
    for obj in objs:
        obj.ref_count_down()


def _orphan_cb(orphan: Callable[[T], None], f: concurrent.futures.Future[T]) -> None:
    if not f.cancelled() and f.exception() is None:
        orphan(f.result())


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
