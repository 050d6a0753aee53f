"""The ``nixl`` tier: entries move between the registered pool and storage through a NIXL agent.

Deployments that already run NIXL (GPUDirect Storage, object stores) keep using it: the tier
stores self-describing, checksummed records (:mod:`lmcache_async.records`) through the plugin
named by ``nixl_backend`` — ``POSIX`` (files; works on CPU-only hosts), ``GDS``/``GDS_MT``
(files through cuFile on GPU hosts) or ``OBJ`` (S3-compatible object stores).

This module is the tier's event-loop side (index, put/get/remove, start and close); the NIXL
resources it holds and their release are :mod:`.resources`, eviction and the release of
removed entries' storage :mod:`.removals`.

Contract (beyond :class:`~lmcache_async.tiers.StorageBackend`):

* Memory is registered with the agent once: the manager's CPU pool and staging area, plus a
  small scratch area of the tier (record headers, and a bounce area for blocks that are not in
  registered memory). Reads land in the buffer from ``alloc`` when it is registered memory,
  else in a staging block, else through the bounce area into the buffer ``alloc`` gave.
* Transfers run on the tier's own worker threads (named ``lmcache-async-<cache>-nixl``), one
  job per batch; coroutines on the loop only plan, account and wait. A cancelled call (the
  manager's ``remote_timeout_s``) never frees a buffer a job still writes: the job finishes
  and its result is released then.
* A request NIXL can neither finish nor abort (:class:`NixlStuckError`) may still write into
  its memory at any later time: its read buffer is never released (it is quarantined:
  ``stats()["stuck"]``, ``["quarantined_bytes"]``), its scratch area is retired and its file
  descriptor and registrations are kept open, all for the life of the process.
* :meth:`close` waits for in-flight jobs, then releases everything; when the close is
  cancelled (the manager bounds it with a timeout), the release still happens, as soon as the
  last in-flight job has finished.
* Every record is verified on read (magic, version, header checksum, key, shape, dtype,
  format, sizes, xxh3-64 of the payload). A bad record is a miss, is removed and is counted;
  a NIXL failure is a miss/False plus a counter and a rate-limited log line.
* Encryption at rest (``encryption_key_file``, file plugins): every record is sealed with
  AES-256-GCM in segments of ``nixl_chunk_bytes`` (one per piece moved), staged through the
  registered bounce area of the worker's scratch slot (:mod:`.nixl_transfer`). A record under
  another key id (or sealed while the tier has no key, or plain while it has one) found by the
  index rebuild is foreign: not indexed (a miss), its file kept, ``foreign_key`` counted; in
  the slot layout its slot counts as free and the next write reuses it. A tag that fails is a
  bad record (removed, ``corrupt``). The ``OBJ`` plugin does not seal: with a key it refuses to
  start (``ValueError`` naming ``encryption_key_file``).
* Capacity: ``nixl_max_size`` GiB of records (header + payload), LRU (or FIFO per
  ``cache_policy``), entries being read are never evicted; bytes are accounted on every
  removal path (eviction, ``remove``, ``clear``, corrupt record).
* Removals are reported (:attr:`reports_removals`), on the loop, once the key has left the index
  (the record's storage may still be going): EVICTED for each entry pushed out to make room
  (also at start, when a smaller ``nixl_max_size`` drops the oldest), DELETED for ``remove``
  (when the key was held) and every key ``clear`` drops, DAMAGED for a record a read finds
  bad (or sealed under another key) and drops, DELETED for a record file found deleted behind
  the tier's back. A scanned record that is foreign or superseded was never held: no report.
* File-backed storage is owned by one tier instance: the directory is locked (``flock``) and
  the index is rebuilt from it at start, so a restarted process reuses the entries. The
  factory uses ``<nixl_path>/<cache>-<worker_id>``; when another live process holds it, the
  tier is left out with a warning instead of sharing it unsafely.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_async.encryption import RecordCipher, cipher_for
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.nixl.agent import (
    HEADER_SCRATCH_BYTES,
    INSTALL_HINT,
    NixlSettings,
    NixlStuckError,
    load_nixl,
    nixl_available,
)
from lmcache_async.nixl.index import Entry, NixlCounters, NixlIndex
from lmcache_async.nixl.io import (
    DirectoryInUseError,
    EntryMeta,
    KeyFileLayout,
    ObjectLayout,
    Scanned,
    SlotFileLayout,
    storage_root,
)
from lmcache_async.nixl.jobs import JobKind
from lmcache_async.nixl.removals import NixlRemovals
from lmcache_async.nixl.work import (
    ReadBatch,
    ReadJob,
    WritePlan,
    no_orphan,
    plan_bytes,
    read_bytes,
    slot_bytes,
)
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import MAX_KEY_LEN, MAX_RANK, ForeignSeal, RecordError, header_length
from lmcache_async.records.sections import SEAL_SECTION_LEN, sealed_length
from lmcache_async.tiers import UNKNOWN, Allocate, BackendContext, CannotTell, RemovalReason

logger = logging.getLogger(__name__)

__all__ = [
    "INSTALL_HINT",
    "DirectoryInUseError",
    "NixlBackend",
    "NixlSettings",
    "NixlStuckError",
    "create",
    "load_nixl",
    "nixl_available",
    "storage_root",
]

_LOG_BURST_S = 5.0


class NixlBackend(NixlRemovals):
    """A storage tier over one NIXL agent; see the module docstring for the contract.

    ``root`` is the storage directory for file-backed plugins (default ``settings.path``) or
    the object-name prefix for ``OBJ``. Construction creates the agent and registers memory
    (it raises :class:`BackendUnavailableError` when NIXL or the plugin is unavailable and
    :class:`DirectoryInUseError` when the directory is locked). :meth:`start` rebuilds the
    index from storage; operations issued before it finishes wait for it. ``cipher``: seal
    every record written and open those read (file plugins only; ``ValueError`` for ``OBJ``).
    """

    name = "nixl"

    def __init__(
        self,
        ctx: BackendContext,
        settings: NixlSettings,
        root: str | Path | None = None,
        cipher: RecordCipher | None = None,
    ) -> None:
        if cipher is not None and settings.is_object_store:
            raise ValueError("encryption_key_file is set but the nixl tier seals records only with file plugins")
        self._ctx = ctx
        self.settings = settings
        self._cipher = cipher
        self._key_id = cipher.key_id if cipher is not None else None
        self._lru = settings.policy == "LRU"
        self._closed = False
        work = self._acquire(ctx, settings, str(root) if root is not None else settings.path, cipher)
        self._index = NixlIndex(settings.max_bytes, self._lru)
        self._writing: dict[CacheEngineKey, asyncio.Future[bool]] = {}
        self._zeroing: set[asyncio.Future[None]] = set()
        self._writes = JobKind("write", work.write, self._finish_writes, work.orphan_writes, plan_bytes)
        self._reads = JobKind("read", work.read, self._finish_reads, work.orphan_reads, read_bytes)
        self._zeroings = JobKind("zero", work.zero, self._finish_zeroing, no_orphan, slot_bytes)
        self._ready = asyncio.Event()
        self._start_task: asyncio.Task[None] | None = None
        self.counters = NixlCounters()
        self._log = RateLimitedLog(logger, _LOG_BURST_S)

    # ---- capabilities -----------------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return not self.settings.is_object_store

    @property
    def is_remote(self) -> bool:
        return True

    @property
    def capacity_bytes(self) -> int:
        """The ``nixl_max_size`` budget in bytes."""
        return self.settings.max_bytes

    @property
    def max_entry_bytes(self) -> int | None:
        """The largest record, header included, this tier could ever hold: the ``nixl_max_size``
        budget (a slot file grows to the record it holds, so the slot layout has the same bound)."""
        return self.settings.max_bytes

    @property
    def reports_removals(self) -> bool:
        """Evictions, ``remove``/``clear`` and records found bad are reported
        (:meth:`report_removed`; see the module docstring)."""
        return True

    @property
    def layout_name(self) -> str:
        """``files``, ``slots`` or ``objects``."""
        return {KeyFileLayout: "files", SlotFileLayout: "slots", ObjectLayout: "objects"}[type(self._layout)]

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Rebuild the index from storage (idempotent; operations wait for it)."""
        if self._closed:
            return
        if self._start_task is None:
            self._start_task = asyncio.get_running_loop().create_task(self._scan())
            self._track(self._start_task)
        await asyncio.shield(self._start_task)

    async def _ensure_ready(self) -> bool:
        if self._closed:
            return False
        if not self._ready.is_set():
            await self.start()
        return not self._closed

    async def _scan(self) -> None:
        assert self._layout is not None
        try:
            found, reaped = await self._run(self._layout.scan)
        except Exception as exc:
            logger.warning("nixl: rebuilding the index failed (%s: %s); starting empty", type(exc).__name__, exc)
            found, reaped = [], 0
        self.counters.reaped += reaped
        # oldest first, so the LRU order follows the files' ages
        removals = [self._admit_scanned(s) for s in found]
        if isinstance(self._layout, SlotFileLayout):
            used = self._index.locations()
            self._index.free_slots = [i for i in reversed(range(self._layout.count)) if i not in used]
        # Over budget after a restart with a smaller nixl_max_size: drop the oldest.
        victims: list[str | int] = []
        self._make_room(0, recycle=victims)
        removals.extend(self._release_location(loc) for loc in victims)
        # Ready once storage holds exactly what the index says (no deletion still running).
        await asyncio.gather(*(r for r in removals if r is not None), return_exceptions=True)
        self._ready.set()

    def _admit_scanned(self, s: Scanned) -> asyncio.Future[Any] | None:
        """Index one scanned record; returns the removal of a record it supersedes or refuses."""
        try:
            key = CacheEngineKey.from_string(s.meta.key)
        except (ValueError, TypeError):
            self.counters.reaped += 1
            return self._discard_storage(s.location)
        if s.key_id != self._key_id:  # another key's record (or plain/sealed against ours): kept
            self.counters.foreign_key += 1
            why = "sealed under another key" if s.key_id is not None else "not sealed"
            self._log.warning("nixl: record %s of %s is %s; not indexed, kept", s.location, s.meta.key, why)
            return None
        old = self._index.add(key, Entry(s.meta, s.location))
        removal = None
        if old is not None:  # two records of one key: keep the newer
            self.counters.reaped += 1
            removal = self._discard_storage(old.location)
        self.counters.scanned += 1
        return removal

    async def close(self) -> None:
        """Refuse new work, wait for in-flight transfers, then release the worker threads,
        registrations, files and the lock. Idempotent.

        Cancelling the close (the manager bounds it with a timeout) does not leak anything:
        the release then runs as soon as the last in-flight job has finished — on the loop,
        or on the job's worker thread when the loop is gone by then. It never runs while a
        job still uses the agent.
        """
        if self._torn_down:
            return
        self._closed = True
        self._ready.set()  # waiters see the tier closed
        try:
            if self._runner is not None:
                await self._runner.drain()
        finally:
            for fut in self._writing.values():
                if not fut.done():
                    fut.set_result(False)
            self._teardown_pending = True
            self._maybe_teardown()

    def _failed(self, what: str, key: CacheEngineKey, exc: BaseException) -> None:
        self.counters.io_errors += 1
        if isinstance(exc, NixlStuckError):
            self.counters.stuck += 1
            # Rare and lasting (memory is withheld for good): always logged.
            logger.error("nixl: %s of %s is stuck in NIXL: %s", what, key, exc)
            return
        self._log.warning("nixl: %s of %s failed: %s: %s", what, key, type(exc).__name__, exc)

    # ---- contains -------------------------------------------------------------------------------
    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """Index lookup on the caller's thread (UNKNOWN until the index was rebuilt)."""
        if self._closed:
            return False
        if not self._ready.is_set():
            return UNKNOWN
        return key in self._index

    async def contains(self, key: CacheEngineKey) -> bool:
        if not await self._ensure_ready():
            return False
        return key in self._index

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        if not await self._ensure_ready():
            return [False] * len(keys)
        index = self._index
        return [k in index for k in keys]

    # ---- put ----------------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return (await self.batched_put([(key, obj)]))[0]

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """Store each entry; one worker job writes the whole batch. A key already present or
        being written is not written again (True, or the in-flight write's result)."""
        if not items:
            return []
        if not await self._ensure_ready():
            return [False] * len(items)
        if self._zeroing and not self._index.free_slots:
            # Slots being zeroed after remove/clear: free in a moment, not worth an eviction.
            await asyncio.gather(*list(self._zeroing), return_exceptions=True)
        answers: list[bool | asyncio.Future[bool]] = []
        plans: list[WritePlan] = []
        loop = asyncio.get_running_loop()
        for key, obj in items:
            if key in self._index:
                answers.append(True)
                continue
            fut = self._writing.get(key)
            if fut is not None:
                answers.append(fut)
                continue
            plan = self._plan_write(key, obj, loop)
            if plan is None:
                answers.append(False)
                continue
            plans.append(plan)
            answers.append(plan.future)
        if plans:
            self._enqueue(self._writes, plans)
        out: list[bool] = []
        for a in answers:
            out.append(a if isinstance(a, bool) else await asyncio.shield(a))
        return out

    def _plan_write(self, key: CacheEngineKey, obj: MemoryObj, loop: asyncio.AbstractEventLoop) -> WritePlan | None:
        kstr = key.to_string()
        klen = len(kstr.encode("utf-8"))
        sealed = self._cipher is not None
        hlen = header_length(klen, len(obj.shape), SEAL_SECTION_LEN if sealed else 0)
        if klen > MAX_KEY_LEN or len(obj.shape) > MAX_RANK or hlen > HEADER_SCRATCH_BYTES:
            self.counters.too_large += 1
            return None
        if sealed:  # one segment per piece moved
            seg = self.settings.chunk_bytes
            segments, stored = sealed_length(obj.nbytes, seg)
            meta = EntryMeta(kstr, tuple(obj.shape), obj.dtype, obj.fmt, hlen, stored, True, seg if segments > 1 else 0)
        else:
            meta = EntryMeta(kstr, tuple(obj.shape), obj.dtype, obj.fmt, hlen, obj.nbytes)
        if meta.total_len > self.settings.max_bytes:
            self.counters.too_large += 1
            return None
        recycle: list[str | int] = []
        if not self._make_room(meta.total_len, recycle):
            for loc in recycle:  # nothing will reuse them
                self._release_location(loc)
            self.counters.no_space += 1
            return None
        layout = self._layout
        assert layout is not None
        location: str | int
        if recycle:  # an evicted entry's file or slot, invalidated and overwritten by the job
            location = recycle[0]
        elif isinstance(layout, SlotFileLayout):
            location = self._index.free_slots.pop()
        else:
            location = layout.new_location(kstr)
        registered = self._work.registered(obj)
        if not registered and not sealed:  # a sealed record always goes through the bounce area
            if layout.piecewise:
                self.counters.bounced += 1
            else:
                self.counters.staged += 1
        self._index.reserved += meta.total_len
        obj.ref_count_up()  # held until the job is done, whatever happens to the caller
        fut: asyncio.Future[bool] = loop.create_future()
        self._writing[key] = fut
        return WritePlan(key, obj, meta, location, fut, registered, recycle)

    def _finish_writes(self, plans: list[WritePlan], outcomes: list[BaseException | None]) -> None:
        """On the loop, after a write job: index what was written, count what failed."""
        layout = self._layout
        slots = layout if isinstance(layout, SlotFileLayout) else None
        for plan, failure in zip(plans, outcomes, strict=True):
            plan.obj.ref_count_down()
            self._index.reserved -= plan.meta.total_len
            # evicted entries' files or slots the job handled besides the record's own
            others = [loc for loc in plan.recycle if loc != plan.location]
            if failure is None:
                self._index.add(plan.key, Entry(plan.meta, plan.location))
                self.counters.writes += 1
                if slots is not None:  # the job zeroed them: free for the next writes
                    self._index.free_slots.extend(int(loc) for loc in others if loc not in slots.stuck)
            else:
                self.counters.write_failures += 1
                self._failed("write", plan.key, failure)
                if slots is not None or plan.location in plan.recycle:
                    # A failed write into a slot or an evicted entry's file may have left part
                    # of a record (or, failing early, the evicted record): invalidate it.
                    self._release_location(plan.location)
                # What the job may not have got to (a consumed file name is gone and its
                # delete is a no-op; a slot is zeroed again): out of the index, so they must
                # not come back at a restart.
                for loc in others:
                    self._release_location(loc)
            del self._writing[plan.key]
            if not plan.future.done():
                plan.future.set_result(failure is None)

    # ---- get ----------------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return (await self.batched_get([key], alloc))[0]

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        """One result per key; one worker job reads every entry found. The caller owns one
        reference to each returned object. A damaged record is a miss, counted, and its file
        is deleted (its slot invalidated) before the call returns."""
        results: list[MemoryObj | None] = [None] * len(keys)
        if not keys or not await self._ensure_ready():
            return results
        reads: list[tuple[int, CacheEngineKey, Entry]] = []
        for i, key in enumerate(keys):
            entry = self._index.begin_read(key)
            if entry is None:
                continue
            reads.append((i, key, entry))
        if not reads:
            return results
        alloc = alloc or self._ctx.staging
        batch = ReadBatch(results)
        jobs: list[ReadJob] = []
        for i, key, entry in reads:
            buf = self._work.read_buffer(entry.meta, alloc, self.counters)
            if buf is None:
                self._reader_done(entry)
                continue
            jobs.append(ReadJob(i, key, entry, buf[0], buf[1], batch))
        if not jobs:
            return results
        done = self._enqueue(self._reads, jobs)
        try:
            await asyncio.shield(done)
            if batch.discards:  # a damaged record is gone by the time its miss is returned
                await asyncio.shield(asyncio.gather(*batch.discards, return_exceptions=True))
        except asyncio.CancelledError:
            batch.abandon()  # what already arrived goes back now, the rest when it arrives
            raise
        return results

    def _finish_reads(self, jobs: list[ReadJob], outcomes: list[BaseException | None]) -> None:
        """On the loop, after a read job: deliver, or drop bad records and count."""
        for job, failure in zip(jobs, outcomes, strict=True):
            self._reader_done(job.entry)
            if failure is None:
                self.counters.reads += 1
                job.batch.deliver(job.index, job.dst)
                continue
            self.counters.read_failures += 1
            if isinstance(failure, NixlStuckError):
                self._quarantine_block(job.dst)  # never job.dst.ref_count_down()
                self._failed("read", job.key, failure)
                continue
            job.dst.ref_count_down()
            if isinstance(failure, ForeignSeal):  # replaced by another key's record: not ours to delete
                self.counters.foreign_key += 1
                self._log.warning("nixl: record of %s is %s; not indexed any more, kept", job.key, failure)
                if self._forget(job.key, job.entry):
                    self.report_removed([job.key], RemovalReason.DAMAGED)
            elif isinstance(failure, (RecordError, FileNotFoundError)):
                self.counters.corrupt += 1
                self._log.warning("nixl: dropping bad record of %s: %s", job.key, failure)
                gone: list[CacheEngineKey] = []
                discard = self._drop(job.key, job.entry, gone)
                if discard is not None:
                    job.batch.discards.append(discard)
                # a file deleted behind the tier's back was deleted, not damaged (as the disk tier)
                vanished = isinstance(failure, FileNotFoundError)
                self.report_removed(gone, RemovalReason.DELETED if vanished else RemovalReason.DAMAGED)
            else:
                self._failed("read", job.key, failure)

    # ---- remove / clear -------------------------------------------------------------------------
    async def remove(self, key: CacheEngineKey) -> bool:
        if not await self._ensure_ready():
            return False
        fut = self._writing.get(key)
        if fut is not None:
            await asyncio.shield(fut)
        entry = self._index.get(key)
        if entry is None:
            return False
        gone: list[CacheEngineKey] = []
        self._drop(key, entry, gone)
        self.report_removed(gone, RemovalReason.DELETED)
        return True

    async def clear(self) -> None:
        """Drop every entry (each key reported DELETED, in one report)."""
        if not await self._ensure_ready():
            return
        if self._writing:
            await asyncio.gather(*self._writing.values(), return_exceptions=True)
        gone: list[CacheEngineKey] = []
        try:
            for key, entry in self._index.items():
                self._drop(key, entry, gone)
        finally:
            self.report_removed(gone, RemovalReason.DELETED)

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._index),
            "bytes": self._index.bytes,
            "reserved_bytes": self._index.reserved,
            "capacity_bytes": self.settings.max_bytes,
            "jobs": self._runner.jobs if self._runner is not None else 0,
            **self.counters.as_dict(),
            "plugin": self.settings.plugin,
            "sealed": self._cipher is not None,
            "layout": self.layout_name if self._layout is not None else "closed",
            "free_slots": len(self._index.free_slots) if isinstance(self._layout, SlotFileLayout) else None,
        }

    def __repr__(self) -> str:
        where = self.root if self.root is not None else self.settings.path
        return f"NixlBackend(plugin={self.settings.plugin}, where={str(where)!r}, entries={len(self._index)})"


def create(ctx: BackendContext) -> NixlBackend | None:
    """Registry factory: the NIXL tier when ``nixl_path`` is set.

    Raises :class:`BackendUnavailableError` naming ``pip install 'lmcache-async[nixl]'``
    when NIXL is missing, and :class:`~lmcache_async.errors.ConfigError` for invalid
    ``nixl_*`` values. Returns None (with a warning) when another process holds the directory.
    """
    if not ctx.config.nixl_path:
        return None
    settings = NixlSettings.from_config(ctx.config)
    cipher = cipher_for(ctx.config)
    if cipher is not None and settings.is_object_store:
        raise ValueError("encryption_key_file is set but the nixl tier seals records only with file plugins")
    load_nixl()
    try:
        return NixlBackend(ctx, settings, storage_root(ctx, settings), cipher)
    except DirectoryInUseError as exc:
        logger.warning("the nixl tier is disabled in this process: %s", exc)
        return None
