"""Shared-filesystem connector (``fs:///dir``): one record file per entry, for NFS/Lustre-style
mounts that many machines see.

* Layout: ``<root>/<prefix>/<model>/<digest[:2]>/<digest>.rec`` (:mod:`.naming`); the file is
  a single-part record (header then payload), verified on every read.
* Publish: the record is written to a hidden temporary name in the same directory
  (``.<digest>.rec.<host>.<pid>.<start>.<random>.tmp``, the scheme every record-file store
  shares: :func:`lmcache_async.records.files.temp_name`) and then published under its final
  name without replacing one that exists: a hard link, which fails if the entry exists and is
  atomic on network filesystems too (:func:`lmcache_async.records.files.publish_noreplace`): a
  reader never sees a partial file, and the first valid writer of a key wins. Where hard links are not
  supported the temporary file is renamed instead (over a missing name only). A record
  already at the name is checked like a read (header, key, sizes, payload checksum): a valid one
  is kept, a damaged or foreign one is deleted (counted) and replaced, so a ``put`` leaves a
  readable record.
* Damage: a read that finds a damaged record, or a record of another key, returns a miss after
  deleting it (counted as ``corrupt`` / ``foreign``), so the key can be stored again. Other
  processes share the directory: the file is first renamed to a private temporary name and
  deleted only if it is still the file that was read (device, inode, size, mtime); a fresh
  record another writer published at the name meanwhile is put back.
* Durability: ``?fsync=none`` (default; close-to-open consistency of network filesystems),
  ``data`` (fsync the file) or ``full`` (file and directory).
* Leftovers: temporary files of writers that are gone (same host) or, from other hosts, older
  than an hour (:func:`lmcache_async.records.files.temp_reapable`) are reaped in the background
  at start and by ``clear``; a live writer's are never touched.
* No eviction of ours: the filesystem's quota governs. ``remote_ttl_s`` is honoured by file age.
* Every whole-file operation is one job on the manager's executor. A filesystem that hangs
  ties up executor threads, so at most ``workers - 1`` jobs are in flight; further calls wait
  (under the manager's timeout, whose failures open the tier's circuit breaker).

A full, read-only or forbidden filesystem makes ``put`` return False (counted, logged); other
I/O errors propagate to the manager.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lmcache_async.disk.layout import make_private_dirs
from lmcache_async.encryption import RecordCipher, new_buffer
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import PROBE_LEN, ForeignSeal, RecordError, RecordHeader
from lmcache_async.records.files import (
    payload_problem,
    publish_noreplace,
    read_header,
    reap_temp,
    reap_temps,
    temp_name,
    write_all,
)
from lmcache_async.tiers import Allocate

from .codec import AllocationFailed, ForeignRecord, allocate, prepare
from .connector import Connector, ConnectorSettings
from .naming import EntryName
from .url import RemoteURL, parse_remote_url, redact

logger = logging.getLogger(__name__)

__all__ = ["FSConnector", "create"]

T = TypeVar("T")

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_LOG_EVERY_S = 5.0
_PUBLISH_TRIES = 4  # publish attempts of one put, each after a damaged record at its name went


class FSConnector(Connector):
    """Records as files below a shared directory; see the module docstring."""

    def __init__(self, url: RemoteURL, settings: ConnectorSettings) -> None:
        if settings.executor is None:
            raise ValueError("the fs:// connector needs an executor for its file operations")
        assert url.path is not None
        self._root = Path(url.path).expanduser().absolute()
        self._fsync = url.options.get("fsync", "none")
        self._ttl = settings.ttl_s
        self._cipher = settings.cipher
        self._key_id = settings.cipher.key_id if settings.cipher is not None else None
        self._executor = settings.executor
        workers = int(getattr(settings.executor, "_max_workers", 4))
        self._limit = max(1, workers - 1)  # leave a thread to the other tiers
        self._inflight = 0
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._reaper: asyncio.Future[None] | None = None
        self._rate_log = RateLimitedLog(logger, _LOG_EVERY_S)
        self.corrupt = 0
        self.foreign = 0
        self.foreign_key = 0
        self.expired = 0
        self.alloc_failed = 0
        self.write_errors = 0
        self.busy = 0
        self.bytes_written = 0
        self.bytes_read = 0

    @property
    def seals(self) -> bool:
        return True

    @property
    def root(self) -> Path:
        """The shared directory."""
        return self._root

    # ---- executor plumbing ----------------------------------------------------------------------
    def _job_done(self, _f: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._inflight -= 1
        loop, sem = self._loop, self._sem
        if loop is not None and sem is not None:
            try:
                loop.call_soon_threadsafe(sem.release)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    async def _run(
        self,
        fn: Callable[..., T],
        *args: Any,
        orphan: Callable[[T], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn(*args)`` as one executor job. ``orphan`` receives a result nobody awaits
        any more (caller cancelled); ``after`` runs when the job is over, however it ended.

        At most ``limit`` jobs are in flight; further callers wait (cancellably) for one to
        end, so a hanging filesystem never takes every executor thread."""
        try:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the fs:// connector is closed")
            if self._sem is None:
                self._sem = asyncio.Semaphore(self._limit)
                self._loop = asyncio.get_running_loop()
            if self._sem.locked():
                self.busy += 1
            await self._sem.acquire()
        except BaseException:
            if after is not None:
                after()
            raise
        try:
            cf = self._executor.submit(fn, *args)
        except BaseException:
            self._sem.release()
            if after is not None:
                after()
            raise
        with self._lock:
            self._inflight += 1
        if after is not None:
            cf.add_done_callback(lambda _f: after())
        cf.add_done_callback(self._job_done)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            if orphan is not None:
                cf.add_done_callback(lambda f: _give_orphan(f, orphan))
            raise

    def _log(self, msg: str, *args: Any) -> None:
        """A warning, at most one every few seconds (any thread)."""
        self._rate_log.warning(msg, *args)

    def _expired(self, mtime: float) -> bool:
        return self._ttl is not None and time.time() - mtime > self._ttl

    def _count(self, counter: str) -> None:
        """Add one to a counter (any thread: executor jobs count what they find)."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def _bad_record(self, path: Path, seen: os.stat_result, exc: RecordError) -> None:
        """Count, log and delete a record file that failed a check (executor thread)."""
        foreign = isinstance(exc, ForeignRecord)
        self._count("foreign" if foreign else "corrupt")
        removed = self._discard(path, seen)
        self._log(
            "fs:// record %s %s; %s",
            path,
            "holds another key" if foreign else f"is corrupt ({exc})",
            "removed" if removed else "not removed (replaced or gone meanwhile)",
        )

    def _discard(self, path: Path, seen: os.stat_result) -> bool:
        """Delete the record file at ``path`` if it is still the file ``seen`` describes; True
        when it was deleted by this call.

        Other processes share the directory, so a fresh record may have been published at the
        name since the damaged one was read (after someone else deleted that one). The file is
        therefore renamed to a private temporary name first (atomic: nobody can publish into it)
        and compared there; a file other than ``seen`` is linked back to its name (unless yet
        another record was published there meanwhile, which then stays). A process killed in
        between leaves a temporary file that is reaped like a dead writer's. A file that cannot
        be deleted (a read-only filesystem, say) stays, logged: it stays a miss."""
        trash = path.parent / temp_name(path.name)
        try:
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                return False  # deleted already (by another reader, a remove, a clear)
            if _same_file(os.stat(trash), seen):
                _unlink(trash)
                return True
            # Someone else's record: put it back, unless yet another one was published meanwhile
            # (that one stays).
            publish_noreplace(trash, path, link_first=True, rename_without_links=True)
            _unlink(trash)
            return False
        except OSError as exc:  # what stays under a temporary name is reaped like a dead writer's
            self._log("fs:// tier cannot remove the record %s: %s", path, exc)
            return False

    def _foreign_seal(self, path: Path, exc: RecordError) -> None:
        self._count("foreign_key")
        self._log("fs:// record %s is not for this tier's key (%s); kept", path, exc)

    def _keep_existing(self, path: Path, key: str) -> bool:
        """A put found a record at its name: True when it is a valid, live record of ``key``
        (kept); False when there is none any more (absent, expired, or damaged/foreign and
        deleted: the caller writes its own). OSError when it cannot be read."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return False
        try:
            st = os.fstat(fd)
            if self._expired(st.st_mtime):
                self._discard(path, st)
                return False
            try:
                hdr = _check_head(fd, st.st_size, key, self._key_id)
                _check_payload(fd, hdr, memoryview(bytearray(hdr.plain_len)), self._cipher)  # checked, not kept
            except ForeignSeal as exc:  # another key's record: kept
                self._foreign_seal(path, exc)
                return True
            except RecordError as exc:
                self._bad_record(path, st, exc)
                return False
            return True
        finally:
            os.close(fd)

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._run(make_private_dirs, self._root)
        # Temporary files of writers that died (killed mid-write) are reaped in the background:
        # a large shared tree must not delay the start.
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        try:
            n = await self._run(functools.partial(reap_temps, self._root, recursive=True))
        except OSError as exc:
            logger.debug("fs:// tier: reaping temporary files under %s failed: %s", self._root, exc)
            return
        if n:
            logger.info("fs:// tier: removed %d temporary files of writers that are gone", n)

    async def close(self) -> None:
        self._closed = True
        reaper = self._reaper
        if reaper is not None and not reaper.done():
            reaper.cancel()

    # ---- put ---------------------------------------------------------------------------------------------
    async def put(self, name: EntryName, obj: MemoryObj) -> bool:
        obj.ref_count_up()  # the job reads the block; it must outlive a cancelled caller
        try:
            stored, nbytes = await self._run(self._put_job, name, obj, after=obj.ref_count_down)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                self._count("write_errors")
                self._log("fs:// tier cannot write under %s: %s", self._root, exc)
                return False
            raise
        if stored is None:
            self._count("write_errors")
            self._log("fs:// tier cannot publish %s: damaged records keep appearing", name.relpath)
            return False
        if stored:
            self.bytes_written += nbytes
        return True

    def _put_job(self, name: EntryName, obj: MemoryObj) -> tuple[bool | None, int]:
        """Encode (seal) and publish ``obj``'s record (executor thread): :meth:`_write`'s
        outcome and the record's size."""
        out = prepare(name, obj, 1 << 62, self._cipher)  # files are never split
        return self._write(self._root / name.relpath, name.key, out.head, out.payload), len(out.head) + len(out.payload)

    def _write(self, path: Path, key: str, head: bytes, payload: memoryview) -> bool | None:
        """Publish one record file of ``key``. False when a valid record was already there (it is
        kept; a damaged or foreign one is replaced); None when one could not be published (a
        damaged record reappeared at the name every time)."""
        if self._keep_existing(path, key):  # a re-put, or another process wrote it
            return False
        make_private_dirs(path.parent)
        tmp = path.parent / temp_name(path.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            try:
                write_all(fd, [memoryview(head), payload])
                if self._fsync == "data":
                    os.fdatasync(fd)
                elif self._fsync == "full":
                    os.fsync(fd)
            finally:
                os.close(fd)
            for _ in range(_PUBLISH_TRIES):
                if publish_noreplace(tmp, path, link_first=True, rename_without_links=True):
                    break
                # Another writer published first: first valid writer wins, a damaged one goes.
                if self._keep_existing(path, key):
                    return False
            else:
                return None
        finally:
            _unlink(tmp)
        if self._fsync == "full":
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return True

    # ---- get ---------------------------------------------------------------------------------------------
    async def get(self, name: EntryName, alloc: Allocate) -> MemoryObj | None:
        """The verified entry, or None. A damaged record, or one of another key, is deleted
        (counted as ``corrupt`` / ``foreign``) before the miss is returned."""
        path = self._root / name.relpath
        try:
            obj = await self._run(self._read, path, name.key, alloc, orphan=_release)
        except RecordError:  # counted, logged and deleted by the job
            return None
        except AllocationFailed:
            self._count("alloc_failed")
            return None
        except _Expired:
            self._count("expired")
            return None
        if obj is not None:
            self.bytes_read += obj.nbytes
        return obj

    def _read(self, path: Path, key: str, alloc: Allocate) -> MemoryObj | None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if self._expired(st.st_mtime):
                self._discard(path, st)
                raise _Expired()
            try:
                hdr = _check_head(fd, st.st_size, key, self._key_id)
                obj = allocate(hdr, alloc)
                try:
                    _check_payload(fd, hdr, obj.byte_view(), self._cipher)
                except BaseException:
                    obj.ref_count_down()
                    raise
            except ForeignSeal as exc:
                self._foreign_seal(path, exc)
                return None
            except RecordError as exc:
                self._bad_record(path, st, exc)
                raise
            return obj
        finally:
            os.close(fd)

    # ---- exists / remove / clear ---------------------------------------------------------------------
    async def exists(self, names: Sequence[EntryName]) -> list[bool]:
        if not names:
            return []
        return await self._run(self._exists, [self._root / n.relpath for n in names])

    def _exists(self, paths: list[Path]) -> list[bool]:
        out = []
        for p in paths:
            try:
                st = os.stat(p)
            except FileNotFoundError:
                out.append(False)
                continue
            out.append(not self._expired(st.st_mtime))
        return out

    async def remove(self, name: EntryName) -> bool:
        return await self._run(_unlink, self._root / name.relpath)

    async def clear(self, prefix: str) -> None:
        await self._run(self._clear, self._root / prefix)

    @staticmethod
    def _clear(top: Path) -> None:
        now = time.time()
        for dirpath, dirnames, filenames in os.walk(top, topdown=False):
            for fn in filenames:
                p = os.path.join(dirpath, fn)
                if fn.endswith(".rec"):
                    _unlink(Path(p))
                else:
                    reap_temp(p, None, now)
            for d in dirnames:
                try:
                    os.rmdir(os.path.join(dirpath, d))
                except OSError:
                    pass  # not empty (a writer is busy there) or already gone

    def stats(self) -> dict[str, Any]:
        return {
            "url": f"fs://{self._root}",
            "fsync": self._fsync,
            "corrupt": self.corrupt,
            "foreign": self.foreign,
            "foreign_key": self.foreign_key,
            "expired": self.expired,
            "alloc_failed": self.alloc_failed,
            "write_errors": self.write_errors,
            "busy": self.busy,
            "in_flight": self._inflight,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
        }


class _Expired(Exception):
    """The record is older than ``remote_ttl_s`` (removed)."""


def _release(obj: MemoryObj | None) -> None:
    if obj is not None:
        obj.ref_count_down()


def _give_orphan(f: concurrent.futures.Future[T], orphan: Callable[[T], None]) -> None:
    if f.cancelled() or f.exception() is not None:
        return
    orphan(f.result())


def _check_head(fd: int, size: int, key: str, key_id: bytes | None) -> RecordHeader:
    """The header of the single-part record in ``fd`` (a file of ``size`` bytes) when it is a
    well-formed record of ``key`` exactly as long as its header says. Raises
    :class:`ForeignRecord` for a record of another key, ``ForeignSeal`` for one the reader's
    key (id ``key_id``) cannot open, RecordError for anything else wrong."""
    hdr = read_header(fd, probe=PROBE_LEN, key_id=key_id)
    if hdr.key != key:
        raise ForeignRecord("record holds another key")
    if hdr.num_parts != 1 or size != hdr.header_len + hdr.payload_len:
        raise RecordError("file size does not match its header")
    return hdr


def _check_payload(fd: int, hdr: RecordHeader, dst: memoryview, cipher: RecordCipher | None) -> None:
    """Read the payload of ``fd``'s record (header ``hdr``) into ``dst`` (the entry's bytes,
    opened with ``cipher`` when sealed: the stored bytes go through a scratch buffer);
    RecordError unless it is whole, its checksum matches and its tag holds."""
    if hdr.seal is None:
        problem = payload_problem(fd, hdr, dst)
        if problem is not None:
            raise RecordError(problem)
        return
    if cipher is None:  # pragma: no cover - _check_head lets a sealed record through only with a key
        raise RecordError("record is sealed")
    stored = new_buffer(hdr.payload_len)
    problem = payload_problem(fd, hdr, stored)
    if problem is not None:
        raise RecordError(problem)
    cipher.open_into(hdr, stored, dst)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """True when ``a`` and ``b`` describe the same, unchanged file."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def create(url: str, settings: ConnectorSettings) -> FSConnector:
    """Registry factory for ``fs://`` URLs."""
    parsed = parse_remote_url(url)
    if parsed.kind != "fs":
        raise ValueError(f"remote_url {redact(url)!r} is not an fs:// URL")
    return FSConnector(parsed, settings)
