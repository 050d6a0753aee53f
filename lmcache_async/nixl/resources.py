"""The ``nixl`` tier's NIXL resources: acquired at construction, released once nothing runs.

:class:`NixlResources` (the base of :class:`~lmcache_async.nixl.tier.NixlBackend`) owns what the
tier holds outside Python's memory management: the storage directory's ``flock``, the NIXL
agent, the memory registrations of the manager's pools, the scratch area, the storage layout
(open, registered files) and the worker threads (:class:`~lmcache_async.nixl.jobs.JobRunner`).
:meth:`NixlResources._acquire` takes them all or, on any failure, releases what it took;
:meth:`NixlResources._teardown` releases them once no job runs any more, except what a stuck
NIXL request may still use (quarantined buffers, registrations, descriptors), which is parked
for the life of the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lmcache_async.disk.layout import make_private_dirs
from lmcache_async.encryption import RecordCipher
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.nixl.agent import NixlAgent, NixlSettings, NixlTransferError, park
from lmcache_async.nixl.index import NixlCounters
from lmcache_async.nixl.io import KeyFileLayout, Layout, ObjectLayout, Scratch, SlotFileLayout, lock_directory
from lmcache_async.nixl.jobs import JobKind, JobRunner
from lmcache_async.nixl.work import NixlWork
from lmcache_async.records.sections import TAG_LEN
from lmcache_async.tiers import BackendContext, StorageBackend

__all__ = ["NixlResources"]

logger = logging.getLogger("lmcache_async.nixl.tier")

T = TypeVar("T")
X = TypeVar("X")


class NixlResources(StorageBackend):
    """The NIXL resources of one tier instance and their release (see the module docstring).

    The attributes are set by :meth:`_acquire` (the tier's constructor calls it once).
    """

    root: Path | None
    """The storage directory of a file plugin; None for ``OBJ``."""
    counters: NixlCounters
    _agent: NixlAgent | None
    _registered: tuple[PoolAllocator, ...]
    _regions: list[Any]
    _scratch: Scratch | None
    _layout: Layout | None
    _work: NixlWork
    _runner: JobRunner | None
    _lock_fd: int | None
    _quarantine: list[MemoryObj]
    _torn_down: bool
    _teardown_pending: bool
    _teardown_lock: threading.Lock

    def _acquire(
        self, ctx: BackendContext, settings: NixlSettings, target: str, cipher: RecordCipher | None
    ) -> NixlWork:
        """Lock the storage directory ``target`` (file plugins), create the agent, register
        the manager's pools, and set up the scratch area, the layout and the worker threads;
        the transfer logic over them is returned (also kept as ``_work``). On any failure
        everything taken so far is released and the exception propagates
        (:class:`BackendUnavailableError`, :class:`~lmcache_async.nixl.io.DirectoryInUseError`)."""
        self._torn_down = False
        self._teardown_pending = False
        self._teardown_lock = threading.Lock()
        self._quarantine = []
        self._lock_fd = None
        self._regions = []
        self._scratch = None
        self._layout = None
        self._runner = None
        self.root = None
        self._agent = None
        try:
            if not settings.is_object_store:
                self.root = Path(target)
                try:
                    make_private_dirs(self.root)
                except OSError as exc:
                    raise BackendUnavailableError(f"nixl_path directory {target!r} cannot be created: {exc}") from exc
                self._lock_fd = lock_directory(self.root)
            self._agent = NixlAgent(f"lmcache-async-{ctx.cache_name}", settings.plugin, settings.params)
            self._registered = tuple(p for p in (ctx.pool, ctx.staging_pool) if p is not None and p.capacity > 0)
            for p in self._registered:
                self._regions.append(self._agent.register_dram(p.base_ptr, p.capacity))
            # A sealed piece is its chunk plus the tag, all in the bounce area.
            bounce = settings.chunk_bytes + (TAG_LEN if cipher is not None else 0)
            self._scratch = Scratch(self._agent, settings.workers, bounce)
            self._layout = self._open_layout(self._agent, settings, target)
            staging = ctx.staging_pool
            registered_staging = staging if any(staging is p for p in self._registered) else None
            work = NixlWork(
                self._agent,
                self._layout,
                self._scratch,
                settings.chunk_bytes,
                self._registered,
                registered_staging,
                cipher,
            )
            self._work = work
            self._runner = JobRunner(
                settings.workers,
                f"lmcache-async-{ctx.cache_name}-nixl",
                2 * settings.chunk_bytes,
                on_idle=self._maybe_teardown,
                on_orphaned_idle=self._teardown,
            )
        except BaseException:
            self._teardown()
            raise
        return work

    def _open_layout(self, agent: NixlAgent, settings: NixlSettings, target: str) -> Layout:
        """The storage layout ``settings`` ask for: objects under the prefix ``target`` (``OBJ``),
        ``nixl_pool_size`` slot files, or one file per entry in :attr:`root`."""
        if settings.is_object_store:
            return ObjectLayout(agent, target)
        assert self.root is not None
        if settings.pool_size:
            return SlotFileLayout(agent, self.root, settings.pool_size)
        return KeyFileLayout(agent, self.root)

    def _maybe_teardown(self) -> None:
        """On the loop: release everything once closed and nothing is in flight."""
        if self._teardown_pending and (self._runner is None or self._runner.idle):
            self._teardown()

    def _teardown(self) -> None:
        """Release everything (idempotent, any thread; only once no job runs)."""
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
        agent = self._agent
        if self._quarantine:  # a stuck request may still write into them: never freed
            park(*self._quarantine)
        if self._runner is not None:
            self._runner.shutdown()
        if self._layout is not None:
            self._layout.close()
            self._layout = None
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        if agent is not None:
            if agent.stuck:
                park(*self._regions)  # the registrations stay with the parked agent
            else:
                for h in self._regions:
                    agent.deregister(h)
            self._regions.clear()
            agent.close()
            self._agent = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- helpers --------------------------------------------------------------------------------
    @property
    def _tasks(self) -> set[asyncio.Future[Any]]:
        """What :meth:`close` waits for (loop thread)."""
        return self._runner.tasks if self._runner is not None else set()

    @property
    def _executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        return self._runner.executor if self._runner is not None else None

    def _track(self, fut: asyncio.Future[Any]) -> None:
        assert self._runner is not None
        self._runner.track(fut)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on a worker thread (index scans, file deletions)."""
        if self._runner is None:
            raise NixlTransferError("the nixl tier is closed")
        return await self._runner.run(fn, *args)

    def _enqueue(self, kind: JobKind[X], items: list[X]) -> asyncio.Future[None]:
        """Queue ``items`` for the next hand-off to the workers (see :meth:`JobRunner.enqueue`)."""
        assert self._runner is not None
        return self._runner.enqueue(kind, items)

    def _quarantine_block(self, obj: MemoryObj) -> None:
        """Keep ``obj`` allocated for good: a stuck request may still write into it."""
        self._quarantine.append(obj)
        self.counters.quarantined_bytes += obj.nbytes
        logger.error(
            "nixl: a %d-byte read buffer is withheld for good (a stuck NIXL request may still write it)",
            obj.nbytes,
        )
