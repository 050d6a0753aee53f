"""The ``nixl`` tier's transfer-job runner: worker threads, job hand-off and in-flight tracking.

The tier's coroutines only plan, account and wait; every blocking NIXL call runs in a job on one
of the runner's worker threads (named ``lmcache-async-<cache>-nixl``). The runner knows nothing
about records or the index: a job is a function over a list of items that returns one outcome per
item (None, or the exception that item met), and a *finish* callback the runner schedules on the
loop with those outcomes.

Contract:

* :meth:`JobRunner.submit`, :meth:`JobRunner.enqueue`, :meth:`JobRunner.run` and
  :meth:`JobRunner.track` are called on the tier's event loop only.
* No task waits on a worker: a job's completion schedules its finish on the loop, so a cancelled
  caller cannot make the bookkeeping be skipped. When the loop is gone by then, the job's
  *orphan* callback runs on the worker thread instead (it gives memory back, nothing else).
* ``on_idle`` runs on the loop whenever a tracked future or a job ended (the owner checks whether
  it may release its resources); ``on_orphaned_idle`` runs on a worker thread when the loop is
  gone and the last live job ended (the owner releases everything there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from lmcache_async.nixl.agent import NixlStuckError, NixlTransferError
from lmcache_async.nixl.transfer import Scratch, ScratchSlot

__all__ = ["JobKind", "JobRunner", "Outcomes", "each_with_slot", "split"]

T = TypeVar("T")
X = TypeVar("X")
Outcomes = list[BaseException | None]
"""One entry per item of a job: None when the item succeeded, else the exception it met."""


@dataclass(frozen=True)
class JobKind(Generic[X]):
    """One kind of worker job (writes, reads, slot zeroing).

    ``run(items)`` does the work on a worker thread, ``finish(items, outcomes)`` does the
    bookkeeping on the loop, ``orphan(items, outcomes)`` runs on the worker instead when the loop
    is gone (give memory back only); ``nbytes`` sizes an item for the split between workers.
    """

    name: str
    run: Callable[[list[X]], Outcomes]
    finish: Callable[[list[X], Outcomes], None]
    orphan: Callable[[list[X], Outcomes], None]
    nbytes: Callable[[X], int]


@dataclass
class _Queued:
    """Work of one kind waiting for the next loop iteration's hand-off."""

    items: list[Any]
    done: asyncio.Future[None]


class JobRunner:
    """Worker threads of one tier and the bookkeeping of what is in flight on them.

    ``workers`` threads; a hand-off is split into at most ``workers`` jobs of similar byte
    counts, and kept whole when it holds less than ``min_split_bytes``.
    """

    def __init__(
        self,
        workers: int,
        thread_name_prefix: str,
        min_split_bytes: int,
        on_idle: Callable[[], None],
        on_orphaned_idle: Callable[[], None],
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers!r}")
        self._workers = workers
        self._min_split_bytes = min_split_bytes
        self._on_idle = on_idle
        self._on_orphaned_idle = on_orphaned_idle
        self._executor: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=thread_name_prefix
        )
        self._live_jobs = 0  # submitted jobs whose bookkeeping has not run yet
        self._jobs_lock = threading.Lock()
        self.tasks: set[asyncio.Future[Any]] = set()
        """Futures and tasks the owner's close waits for (loop thread only)."""
        self._queued: dict[str, _Queued] = {}
        self.jobs = 0
        """How many jobs were handed to the workers."""

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The worker pool; None once :meth:`shutdown` ran."""
        return self._executor

    @property
    def idle(self) -> bool:
        """Nothing tracked and no live job (loop thread)."""
        return not self.tasks and self._live_jobs == 0

    def shutdown(self) -> None:
        """Stop accepting jobs (any thread; does not wait for running ones)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def drain(self) -> None:
        """Wait until every tracked future is done; a cancelled caller leaves them running."""
        while self.tasks:
            await asyncio.shield(asyncio.gather(*list(self.tasks), return_exceptions=True))

    # ---- tracking ---------------------------------------------------------------------------------
    def track(self, fut: asyncio.Future[Any]) -> None:
        """Keep ``fut`` in :attr:`tasks` until it is done (loop thread)."""
        self.tasks.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: asyncio.Future[Any]) -> None:
        self.tasks.discard(fut)
        self._on_idle()

    def _job_started(self) -> None:
        with self._jobs_lock:
            self._live_jobs += 1

    def _job_ended(self, loop_gone: bool = False) -> None:
        """A job's bookkeeping ran (on the loop), or the loop is gone and it never will (on
        the worker thread: nothing else runs on the loop, so the last job releases all)."""
        with self._jobs_lock:
            self._live_jobs -= 1
            idle = self._live_jobs == 0
        if loop_gone:
            if idle:
                self._on_orphaned_idle()
        else:
            self._on_idle()

    def _end_job_from_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._job_ended)
        except RuntimeError:  # the loop is closed
            self._job_ended(loop_gone=True)

    # ---- running work -----------------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread (index scans, file deletions).

        Raises :class:`NixlTransferError` once the runner is shut down.
        """
        executor = self._executor
        if executor is None:
            raise NixlTransferError("the nixl tier is closed")
        loop = asyncio.get_running_loop()
        self._job_started()
        try:
            cf = executor.submit(fn, *args)
        except RuntimeError as exc:
            self._job_ended()
            raise NixlTransferError("the nixl tier is closed") from exc
        cf.add_done_callback(lambda _: self._end_job_from_worker(loop))
        return await asyncio.wrap_future(cf)

    def submit(
        self,
        fn: Callable[[list[X]], Outcomes],
        items: list[X],
        finish: Callable[[list[X], Outcomes], None],
        orphan: Callable[[list[X], Outcomes], None],
    ) -> asyncio.Future[None]:
        """Run ``fn(items)`` on a worker thread, then ``finish(items, outcomes)`` on the loop.

        The returned future is done once ``finish`` ran. When the runner is shut down, ``finish``
        runs at once with a :class:`NixlTransferError` for every item.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self.track(done)
        self._job_started()

        def run_finish(outcomes: Outcomes) -> None:
            try:
                finish(items, outcomes)
            finally:
                if not done.done():
                    done.set_result(None)
                self._job_ended()

        def on_job_done(cf: concurrent.futures.Future[Outcomes]) -> None:
            try:
                outcomes = cf.result()
            except BaseException as exc:  # cancelled at shutdown, or a bug in the job
                outcomes = [exc] * len(items)
            try:
                loop.call_soon_threadsafe(run_finish, outcomes)
            except RuntimeError:
                try:
                    orphan(items, outcomes)
                finally:
                    self._job_ended(loop_gone=True)

        executor = self._executor
        try:
            if executor is None:
                raise NixlTransferError("the nixl tier is closed")
            cf = executor.submit(fn, items)
        except (RuntimeError, NixlTransferError) as exc:
            run_finish([exc] * len(items))
        else:
            cf.add_done_callback(on_job_done)
        return done

    def enqueue(self, kind: JobKind[X], items: list[X]) -> asyncio.Future[None]:
        """Queue ``items`` for the hand-off at the next loop iteration (loop thread).

        Every call of ``kind`` made during this iteration goes out together, split into at most
        one job per worker (see :meth:`submit`), so concurrent single ``put``/``get`` calls pay
        one thread hand-off between them, like one batch. The returned future is done once every
        item queued with it was finished.
        """
        q = self._queued.get(kind.name)
        if q is None:
            loop = asyncio.get_running_loop()
            q = _Queued([], loop.create_future())
            self._queued[kind.name] = q
            self.track(q.done)  # the owner's close waits for it
            loop.call_soon(self._hand_off, kind)
        q.items.extend(items)
        return q.done

    def _hand_off(self, kind: JobKind[Any]) -> None:
        q = self._queued.pop(kind.name)
        groups = split(q.items, self._workers, kind.nbytes, self._min_split_bytes) if q.items else []
        futs = [self.submit(kind.run, group, kind.finish, kind.orphan) for group in groups]
        self.jobs += len(futs)

        def all_done(_: object) -> None:
            if not q.done.done():
                q.done.set_result(None)

        asyncio.gather(*futs).add_done_callback(all_done)


def each_with_slot(scratch: Scratch, items: list[X], work: Callable[[ScratchSlot, X], None]) -> Outcomes:
    """Worker thread: ``work(slot, item)`` for every item; one outcome per item.

    A stuck request retires its scratch slot and the remaining items go on with a fresh one; when
    no scratch slot can be had, the remaining items fail with that error.
    """
    out: Outcomes = []
    while len(out) < len(items):
        try:
            with scratch.slot() as slot:
                for item in items[len(out) :]:
                    try:
                        work(slot, item)
                    except NixlStuckError as exc:
                        out.append(exc)
                        scratch.retire(slot)
                        break
                    except Exception as exc:
                        out.append(exc)
                    else:
                        out.append(None)
        except Exception as exc:  # no scratch area to be had
            out.extend([exc] * (len(items) - len(out)))
    return out


def split(items: list[X], parts: int, nbytes: Callable[[X], int], min_bytes: int) -> list[list[X]]:
    """``items`` in at most ``parts`` contiguous groups of similar byte counts (one group
    when there is too little work to share)."""
    total = sum(nbytes(i) for i in items)
    parts = min(parts, len(items), max(1, total // max(min_bytes, 1)))
    if parts <= 1:
        return [items]
    groups: list[list[X]] = [[]]
    acc = 0
    share = total / parts
    for it in items:
        if groups[-1] and acc >= share * len(groups) and len(groups) < parts:
            groups.append([])
        groups[-1].append(it)
        acc += nbytes(it)
    return groups
