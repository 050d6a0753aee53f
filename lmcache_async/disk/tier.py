"""The local disk tier (``local_disk``, ``max_local_disk_size`` GiB, ``local_disk_fsync``).

One self-describing record file per entry (:mod:`lmcache_async.records`), named after a hash of
the key string in one of 256 shard directories (:mod:`.layout`). This module is the async
half (event loop: batching, de-duplication, cancellation, start-up); the blocking whole-file
operations, the index and the counters live in :mod:`.store`, the shared budget in
:mod:`.budget`, the awaiting of executor jobs in :mod:`.executor_jobs`. Contract on top of
:class:`~lmcache_async.tiers.StorageBackend`:

* **Atomic publish.** A record is written to a unique temporary name in its shard directory and
  renamed to its final name without replacing an existing one, so readers see a whole record or
  none, and concurrent writers of one key (threads or processes) leave exactly one file.
  ``local_disk_fsync``: ``none`` (default) survives a crash of any process; ``data`` also
  fsyncs the record before the rename, so after a power loss an entry is either whole or absent;
  ``full`` also fsyncs the directory after the rename, so an entry whose ``put`` returned
  survives a power loss. With ``none`` a power loss may leave damaged records: they fail their
  checksums and are treated as corrupt (never returned).
* **Shared directory.** Processes sharing a directory (TP ranks, scheduler and workers) see each
  other's entries: a miss in the in-memory index always looks at the file. The byte budget is
  per directory (:mod:`.disk_budget`), exact across processes, repaired after a crash by the
  next lock holder or at the latest by the next start; LRU eviction by
  bytes (each process evicts in its own LRU order, falling back to file mtimes for entries it
  has not seen). Reads refresh a file's mtime (at most once a minute) so the order survives
  restarts.
* **Start.** :meth:`DiskBackend.start` rebuilds the index in the background by reading record
  headers, recounts the directory's bytes, reaps temporary files whose writer is gone and evicts
  down to the budget. Until then every lookup simply looks at the file.
* **Lookups** (``contains``/``contains_nowait``/``batched_contains``) ``os.stat`` the entry's
  file, also for an entry in the index: a file deleted behind the tier's back (by hand, by
  another process's eviction) is never reported present. No such file is "absent" (an index
  entry for it is dropped and its shard's accounting repaired on the executor); any other error
  (EACCES, EIO, a closed tier) is "unknown" (``contains_nowait`` returns None, ``contains``
  raises OSError, which the manager counts). Whether a present file is also readable is for
  ``get`` to find out.
* **Put over an existing record** keeps it only when it is a valid record of the key (checked
  like a read: header, key, size, payload checksum); a damaged or foreign one is deleted
  (counted as ``corrupt``) and replaced, so a ``put`` that returns True leaves a readable record
  (or one another writer published meanwhile).
* **Remove/clear after an abandoned put.** A write whose caller gave up keeps running; a
  ``remove`` of its key (``clear``: of any key) waits for it, so it never publishes afterwards.
* **Trouble.** A truncated, corrupt or foreign file is a miss, is deleted and counted.
  ``ENOSPC``/``EDQUOT``/``EROFS``/``EACCES``/``EPERM``/``EFBIG`` stop writes (counted, logged
  once); reads go on; writes are retried after a back-off and resume when they succeed.
* **I/O.** One executor job per whole file operation (open, write/read, close): measured faster
  than aiofiles, which makes one thread hop per call (see ``lmcache_async_bench.disk``). Reads
  land straight in the buffer from ``alloc`` (``readinto``); no intermediate copy.
  :meth:`DiskBackend.read_into` reads on the caller's thread straight into caller-owned memory
  (a :class:`~lmcache_async.read_sinks.ReadSink`: the KV connector's paged blocks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache_async.disk.executor_jobs import await_job, gather_jobs, release, release_refs
from lmcache_async.disk.layout import NUM_SHARDS, entry_path, key_digest
from lmcache_async.disk.store import EXISTS, STORED, DiskStore, FsyncPolicy
from lmcache_async.encryption import RecordCipher, cipher_for
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, gib_to_bytes
from lmcache_async.read_sinks import ReadSink
from lmcache_async.records import header_length
from lmcache_async.tiers import UNKNOWN, Allocate, BackendContext, CannotTell, RemovalReason, StorageBackend

if TYPE_CHECKING:
    from lmcache_async.disk.leases import LeaseDir

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SCAN_GROUP = 16  # shards per rebuild job
_CLOSE_WAIT_S = 4.0  # below the manager's minimum close timeout (5 s)

__all__ = ["DiskBackend", "create"]


class DiskBackend(StorageBackend):
    """The disk tier over one directory; see the module docstring for the contract.

    ``executor`` runs every blocking file operation (:class:`~.disk_store.DiskStore`, one job
    per whole file operation); ``staging`` allocates read buffers when a caller passes no
    ``alloc``. ``write_retry_s`` is the first back-off after writes stopped on a storage error
    (doubling up to ``write_retry_max_s``). ``cipher``: seal every record written and open
    those read (``encryption_key_file``); records sealed under another key, or plain ones while
    a cipher is set, are misses that stay (``foreign_key``). Coroutines run on one event loop
    (the manager's).
    """

    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        budget_bytes: int,
        *,
        executor: concurrent.futures.Executor,
        staging: Allocate,
        fsync: FsyncPolicy = "none",
        write_retry_s: float = 1.0,
        write_retry_max_s: float = 30.0,
        scan_jobs: int = 2,
        write_jobs: int = 4,
        cipher: RecordCipher | None = None,
    ) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if fsync not in ("none", "data", "full"):
            raise ValueError(f"fsync must be 'none', 'data' or 'full', got {fsync!r}")
        if write_retry_s <= 0 or write_retry_max_s < write_retry_s:
            raise ValueError("write_retry_s must be > 0 and <= write_retry_max_s")
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as exc:  # a read-only parent, say: reads of what exists may still work
            logger.warning("disk tier: cannot create %s: %s", self.root, exc)
        self.budget_bytes = budget_bytes
        self.fsync: FsyncPolicy = fsync
        self.store = DiskStore(
            self.root,
            budget_bytes,
            fsync=fsync,
            write_retry_s=write_retry_s,
            write_retry_max_s=write_retry_max_s,
            cipher=cipher,
        )
        self.store.on_removed = self._removed
        self._executor = executor
        self._staging = staging
        self._writing: dict[bytes, asyncio.Future[bool]] = {}
        self._jobs: set[concurrent.futures.Future[Any]] = set()
        self._scan_task: asyncio.Task[None] | None = None
        self._scan_jobs = max(1, scan_jobs)
        self._write_jobs = max(1, write_jobs)
        self._closed = False
        self.rebuild_done = False
        self.rebuild_entries = 0
        self.rebuild_seconds = 0.0

    # ---- capabilities ----------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return True

    @property
    def shared(self) -> bool:
        return True

    @property
    def max_entry_bytes(self) -> int | None:
        """The largest record, header included, the directory's budget can ever hold."""
        return self.budget_bytes

    # ---- plumbing ----------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        cf = self._executor.submit(fn, *args)
        self._jobs.add(cf)
        cf.add_done_callback(self._jobs.discard)
        return cf

    _await = staticmethod(await_job)
    _gather = staticmethod(gather_jobs)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start rebuilding the index in the background (returns at once)."""
        if self._scan_task is None and not self._closed:
            self._scan_task = asyncio.get_running_loop().create_task(self._rebuild())

    async def _rebuild(self) -> None:
        t0 = time.perf_counter()
        self.store.begin_scan()
        sem = asyncio.Semaphore(self._scan_jobs)

        async def one(shards: list[int]) -> list[tuple[int, bytes, int]]:
            async with sem:
                return await self._await(self._submit(self.store.scan_group, shards))

        try:
            groups = [list(range(i, min(i + _SCAN_GROUP, NUM_SHARDS))) for i in range(0, NUM_SHARDS, _SCAN_GROUP)]
            parts = await asyncio.gather(*(one(g) for g in groups))
            found = [item for part in parts for item in part]
            self.rebuild_entries = len(found)
            await self._await(self._submit(self.store.merge_scan, found))
            try:
                await self._await(self._submit(self.store.evict_to_budget))
            except OSError as exc:
                logger.warning("disk tier %s: cannot evict down to the budget: %s", self.root, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("disk tier %s: index rebuild failed; lookups still read files", self.root)
            self.store.abort_scan()
        self.rebuild_seconds = time.perf_counter() - t0
        self.rebuild_done = True

    async def wait_ready(self) -> None:
        """Wait until the start-up rebuild (index, accounting, eviction to budget) finished."""
        task = self._scan_task
        if task is not None and not task.done():
            await asyncio.shield(task)

    async def flush(self) -> None:
        """Wait for every file operation started so far (``put`` already returns after publishing)."""
        pending = [asyncio.wrap_future(cf) for cf in list(self._jobs)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def close(self) -> None:
        """Stop the rebuild, wait (bounded) for running file operations, close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            task = self._scan_task
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            pending = [asyncio.wrap_future(cf) for cf in list(self._jobs)]
            if pending:
                done, not_done = await asyncio.wait(pending, timeout=_CLOSE_WAIT_S)
                for f in done:
                    if not f.cancelled():
                        f.exception()
                if not_done:
                    logger.warning("disk tier %s: %d file operations still running at close", self.root, len(not_done))
        finally:
            self.store.close()  # jobs still running afterwards fail cleanly (counted)

    # ---- backend interface --------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Write ``obj``'s record (True when stored, or when a valid record of the key is already
        there: it is kept; a damaged or foreign one is replaced. False when writes are stopped,
        the budget cannot make room, the write failed, or an existing record cannot be read)."""
        return (await self.batched_put([(key, obj)]))[0]

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """:meth:`put` for each item, one loop wake-up per batch. The files are written by at most
        ``write_jobs`` executor jobs, each writing its share one file after the other: fewer
        thread hand-offs per file than one job per file, the same parallelism."""
        for key, obj in items:
            _check_key(key)
            if not isinstance(obj, MemoryObj):
                raise TypeError(f"obj must be a MemoryObj, got {type(obj).__name__}")
        out = [False] * len(items)
        if self._closed or not items:
            return out
        loop = asyncio.get_running_loop()
        waits: list[tuple[int, asyncio.Future[bool]]] = []
        planned: list[tuple[int, bytes, str, MemoryObj, asyncio.Future[bool]]] = []
        for i, (key, obj) in enumerate(items):
            kstr = key.to_string()
            digest = key_digest(kstr)
            running = self._writing.get(digest)
            if running is not None:  # the same key is being written: share its outcome
                waits.append((i, running))
                continue
            if not self.store.writes_allowed():
                self.store.count("writes_refused")
                continue
            if header_length(len(kstr.encode("utf-8")), len(obj.shape)) + obj.nbytes > self.budget_bytes:
                self.store.count("no_space")
                continue
            done: asyncio.Future[bool] = loop.create_future()
            self._writing[digest] = done
            planned.append((i, digest, kstr, obj, done))
        n_groups = min(len(planned), self._write_jobs)
        groups = [planned[g::n_groups] for g in range(n_groups)]
        cfs: list[concurrent.futures.Future[list[str | BaseException]]] = []
        submitted: list[list[tuple[int, bytes, str, MemoryObj, asyncio.Future[bool]]]] = []
        for group in groups:
            objs = [obj for _, _, _, obj, _ in group]
            for obj in objs:  # the job reads the blocks even if this call is cancelled
                obj.ref_count_up()
            try:
                cf = self._submit(self._write_group, [(d, k, o) for _, d, k, o, _ in group])
            except RuntimeError:  # the executor was shut down
                for obj in objs:
                    obj.ref_count_down()
                for _, d, _, _, f in group:
                    self._settle_write(d, f, asyncio.CancelledError())
                continue
            cf.add_done_callback(functools.partial(release_refs, objs))
            cfs.append(cf)
            submitted.append(group)
        try:
            results = await self._gather(cfs)
        except asyncio.CancelledError:
            # The caller gave up, the jobs may run on: until each ends, a put of its key shares
            # it and remove/clear wait for it (it must not publish after them).
            for group, cf in zip(submitted, cfs, strict=True):
                for j, (_i, d, _k, _o, f) in enumerate(group):
                    cf.add_done_callback(functools.partial(self._write_ended, loop, d, f, j))
            raise
        for group, res in zip(submitted, results, strict=True):
            for j, (i, d, _k, _o, f) in enumerate(group):
                r = res if isinstance(res, BaseException) else res[j]
                if not isinstance(r, BaseException):
                    out[i] = r in (STORED, EXISTS)
                self._settle_write(d, f, r)
        for i, f in waits:
            out[i] = await asyncio.shield(f)
        return out

    def _write_group(self, group: list[tuple[bytes, str, MemoryObj]]) -> list[str | BaseException]:
        """Write records one after the other (executor thread); one outcome per record."""
        out: list[str | BaseException] = []
        for digest, kstr, obj in group:
            try:
                out.append(self.store.write(digest, kstr, obj))
            except Exception as exc:  # one bad file must not fail its neighbours
                out.append(exc)
        return out

    def _write_ended(
        self,
        loop: asyncio.AbstractEventLoop,
        digest: bytes,
        done: asyncio.Future[bool],
        index: int,
        cf: concurrent.futures.Future[list[str | BaseException]],
    ) -> None:
        """Done-callback of an abandoned write job (any thread): settle the shared outcome of its
        ``index``-th record on the loop."""
        if cf.cancelled():
            outcome: str | BaseException = asyncio.CancelledError()
        else:
            exc = cf.exception()
            outcome = exc if exc is not None else cf.result()[index]
        try:
            loop.call_soon_threadsafe(self._settle_write, digest, done, outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _settle_write(self, digest: bytes, done: asyncio.Future[bool], outcome: str | BaseException) -> None:
        """Resolve a write's shared outcome and forget it (once; loop thread)."""
        if done.done():
            return
        if self._writing.get(digest) is done:
            del self._writing[digest]
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, asyncio.CancelledError):
                self.store.count("write_errors")
                self.store.warn("job", "disk tier: write failed: %r", outcome)
            done.set_result(False)
        else:
            done.set_result(outcome in (STORED, EXISTS))

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        """Read the record into a buffer from ``alloc`` (the staging area when None), verified
        (key, sizes, xxh3); None on a miss or any damage (a damaged file is deleted)."""
        return (await self.batched_get([key], alloc))[0]

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        """:meth:`get` for each key: one executor job per file, one loop wake-up per batch.
        If the caller is cancelled, buffers of reads still running are released when they end."""
        for key in keys:
            _check_key(key)
        out: list[MemoryObj | None] = [None] * len(keys)
        if self._closed or not keys:
            return out
        use = alloc or self._staging
        cfs: list[concurrent.futures.Future[MemoryObj | None]] = []
        for key in keys:
            kstr = key.to_string()
            try:
                cfs.append(self._submit(self.store.read, key_digest(kstr), kstr, use))
            except RuntimeError:  # the executor was shut down
                break
        results = await self._gather(cfs, release)
        for i, r in enumerate(results):
            if isinstance(r, MemoryObj):
                out[i] = r
            elif isinstance(r, BaseException):
                self.store.count("read_errors")
                self.store.warn("job", "disk tier: read failed: %r", r)
        return out

    def read_into(self, key: CacheEngineKey, sink: ReadSink) -> bool:
        """Read ``key``'s verified payload straight into ``sink`` on the calling thread
        (:class:`~lmcache_async.tiers.DirectReader`; blocking, any thread but an event
        loop's): True for a hit; False for a miss, a closed tier, a record of another shape or
        dtype, or damage (the file is deleted and counted), and the sink's bytes are then not
        to be used. Never raises for storage trouble."""
        _check_key(key)
        if self._closed:
            return False
        kstr = key.to_string()
        return self.store.read_into(key_digest(kstr), kstr, sink)

    def read_into_many(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """:meth:`read_into` for each pair, in order (the batch form of
        :class:`~lmcache_async.tiers.DirectReader`); ``prefix`` stops at the first key not
        filled."""
        out = [False] * len(keys)
        for i, (key, sink) in enumerate(zip(keys, sinks, strict=True)):
            out[i] = self.read_into(key, sink)
            if prefix and not out[i]:
                break
        return out

    def _lookup(self, key: CacheEngineKey) -> bool:
        """One ``os.stat`` of the entry's file (an index hit is not trusted: the file may have
        been deleted behind the tier's back). Raises OSError when the answer is unknown: the tier
        is closed, or the file cannot be looked at (EACCES, EIO, ELOOP, ...). Only "no such file"
        (ENOENT, ENOTDIR) means absent; an index entry for it is dropped then and its shard's
        accounting repaired in the background (any thread; no blocking beyond the stat)."""
        if self._closed:
            raise OSError(errno.EBADF, "disk tier is closed", self.root)
        digest = key_digest(key.to_string())
        try:
            return os.stat(entry_path(self.root, digest)).st_size >= 64
        except (FileNotFoundError, NotADirectoryError):
            if digest in self.store and self.store.forget_vanished(digest, key.to_string()):
                self._repair_later(digest[0])
            return False

    def _repair_later(self, shard: int) -> None:
        """Recount ``shard`` on the executor (any thread); if the executor is gone, at this
        process's next hold of the directory lock."""
        try:
            self._submit(self.store.repair_shard, shard)
        except RuntimeError:  # the executor was shut down
            self.store.budget.recount_later(shard)

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of each key; raises OSError when a lookup cannot tell (see :meth:`contains`)."""
        return [self._lookup(_check_key(k)) for k in keys]

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """One ``os.stat`` of the entry's file (any thread; see :meth:`_lookup`). UNKNOWN (the
        manager then asks :meth:`contains` on its loop, which raises and so is counted) when the
        tier is closed or the file cannot be looked at; False only when there is no such file."""
        try:
            return self._lookup(key)
        except OSError:
            return UNKNOWN

    async def contains(self, key: CacheEngineKey) -> bool:
        """True when the entry's file is there. Raises OSError when that cannot be told (closed
        tier, EACCES, EIO, ...), so the manager answers "unknown" and counts the error instead of
        answering "absent" for an entry that may well exist."""
        return self._lookup(_check_key(key))

    # ---- declared capabilities -------------------------------------------------------------------
    def as_direct_reader(self) -> DiskBackend:
        return self

    def as_leasing(self) -> DiskBackend:
        return self

    def leases(self, ttl_s: float) -> LeaseDir:
        """Hard-linked records under ``<root>/.ec-leases``, reaped after ``ttl_s`` seconds
        (:class:`~lmcache_async.tiers.Leasing`; :mod:`.disk_leases`)."""
        from lmcache_async.disk.leases import LeaseDir

        return LeaseDir(self.root, max_age_s=ttl_s, cipher=self.store.cipher)

    @property
    def reports_removals(self) -> bool:
        """Every removal this tier makes is reported with the entry's key: :meth:`remove`
        (DELETED), budget evictions (EVICTED, also of other processes' records: the record
        header names their key), files found deleted behind its back (DELETED) and records found
        damaged and deleted (DAMAGED), and what :meth:`clear` deletes (DELETED, shard by shard)."""
        return True

    def _removed(self, kstrs: list[str], reason: RemovalReason) -> None:
        """The store dropped the entries of ``kstrs`` on its own (any thread; see
        :attr:`DiskStore.on_removed`)."""
        keys = []
        for kstr in kstrs:
            try:
                keys.append(CacheEngineKey.from_string(kstr))
            except ValueError:  # a record header naming no key of ours (a foreign writer)
                continue
        self.report_removed(keys, reason)

    async def remove(self, key: CacheEngineKey) -> bool:
        _check_key(key)
        if self._closed:
            return False
        digest = key_digest(key.to_string())
        running = self._writing.get(digest)
        if running is not None:  # also a write whose caller gave up: it must not publish later
            await asyncio.shield(running)
        removed = bool(await self._await(self._submit(self.store.remove, digest)))
        if removed:
            self.report_removed([key], RemovalReason.DELETED)
        return removed

    async def clear(self) -> None:
        """Delete every entry in the directory (other processes' too: the directory is the tier).
        Writes of this process still running when it is called (also those whose caller gave
        up) end first, so none of them publishes an entry after the clear."""
        if self._closed:
            return
        running = list(self._writing.values())
        if running:
            await asyncio.wait(running)
        await self._await(self._submit(self.store.clear))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.store.counters()
        acct_bytes, acct_files = self.store.budget.peek()
        out.update(
            entries=len(self.store),
            bytes=acct_bytes,
            files=acct_files,
            budget_bytes=self.budget_bytes,
            writes_stopped=self.store.writes_stopped,
            recovered_shards=self.store.budget.recovered_shards,
            rebuild_done=self.rebuild_done,
            rebuild_entries=self.rebuild_entries,
            rebuild_seconds=self.rebuild_seconds,
            fsync=self.fsync,
            io="executor",
            path=self.root,
        )
        return out

    def accounted(self) -> tuple[int, int]:
        """``(bytes, files)`` of the directory, read now under the lock (blocking; for tests
        and tools)."""
        return self.store.budget.snapshot()


def _check_key(key: CacheEngineKey) -> CacheEngineKey:
    if type(key) is not CacheEngineKey:
        raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
    return key


def create(ctx: BackendContext) -> DiskBackend | None:
    """Registry factory: the disk tier when ``local_disk`` is set.

    ``max_local_disk_size`` <= 0 with ``local_disk`` set builds no tier (a warning says so):
    there is no safe default size for someone else's disk.
    """
    cfg = ctx.config
    if not cfg.local_disk:
        return None
    if cfg.max_local_disk_size <= 0:
        logger.warning(
            "local_disk is set to %r but max_local_disk_size is %s GiB: the disk tier is "
            "disabled; set max_local_disk_size to the directory's budget in GiB",
            cfg.local_disk,
            cfg.max_local_disk_size,
        )
        return None
    return DiskBackend(
        cfg.local_disk,
        gib_to_bytes(cfg.max_local_disk_size),
        executor=ctx.executor,
        staging=ctx.staging,
        fsync=cfg.local_disk_fsync,
        write_jobs=cfg.executor_workers,
        cipher=cipher_for(cfg),
    )
