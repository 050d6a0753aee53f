"""Shared-filesystem connector (``fs:///dir``): one record file per entry, for NFS/Lustre-style
mounts that many machines see.

* Layout: ``<root>/<prefix>/<model>/<digest[:2]>/<digest>.rec`` (:mod:`.naming`); the file is
  a single-part record (header then payload), verified on every read.
* Publish: the record is written to a hidden temporary name in the same directory
  (``.<digest>.rec.<host>.<pid>.<random>.tmp``) and then hard-linked to its final name, which
  fails if the entry exists: a reader never sees a partial file, and the first writer of a key
  wins. Where hard links are not supported the temporary file is renamed instead.
* Durability: ``?fsync=none`` (default; close-to-open consistency of network filesystems),
  ``data`` (fsync the file) or ``full`` (file and directory).
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
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from lmcache_async.backend import Allocate
from lmcache_async.backends.disk_layout import make_private_dirs
from lmcache_async.memory import MemoryObj
from lmcache_async.records import PROBE_LEN, RecordError, decode_header, peek_header_len

from .codec import AllocationFailed, ForeignRecord, allocate, prepare
from .connector import Connector, ConnectorSettings
from .naming import EntryName
from .url import RemoteURL, parse_remote_url, redact

logger = logging.getLogger(__name__)

__all__ = ["FSConnector", "create"]

T = TypeVar("T")

STALE_TMP_S = 900.0
"""Temporary files older than this are leftovers of a writer that died (removed by ``clear``)."""
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV})
_LOG_EVERY_S = 5.0


def _writer_gone(host: str, pid_text: str) -> bool:
    """True when a temporary file's writer ran on this host and is no longer alive."""
    if host != _host_tag().rsplit(".", 1)[0] or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def reap_dead_writers(root: Path) -> int:
    """Delete temporary files below ``root`` whose writer (same host) is gone, or that are older
    than :data:`STALE_TMP_S` (writers on other hosts); returns how many were deleted."""
    now = time.time()
    reaped = 0
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            if fn.endswith(".tmp") and _reap_temp(os.path.join(dirpath, fn), now):
                reaped += 1
    return reaped


def _reap_temp(path: str, now: float) -> bool:
    """Delete one temporary file if its writer is gone or it is stale; True when deleted."""
    parts = os.path.basename(path).split(".")  # .<digest>.rec.<host>.<pid>.<random>.tmp
    try:
        stale = len(parts) >= 5 and _writer_gone(parts[-4], parts[-3])
        if not stale:
            stale = now - os.stat(path).st_mtime > STALE_TMP_S
        if stale:
            os.unlink(path)
    except OSError:
        return False
    return stale


def _host_tag() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:32]
    return f"{host or 'host'}.{os.getpid()}"


class FSConnector(Connector):
    """Records as files below a shared directory; see the module docstring."""

    def __init__(self, url: RemoteURL, settings: ConnectorSettings) -> None:
        if settings.executor is None:
            raise ValueError("the fs:// connector needs an executor for its file operations")
        assert url.path is not None
        self._root = Path(url.path).expanduser().absolute()
        self._fsync = url.options.get("fsync", "none")
        self._ttl = settings.ttl_s
        self._executor = settings.executor
        workers = int(getattr(settings.executor, "_max_workers", 4))
        self._limit = max(1, workers - 1)  # leave a thread to the other tiers
        self._inflight = 0
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._reaper: asyncio.Future[None] | None = None
        self._last_log = 0.0
        self.corrupt = 0
        self.foreign = 0
        self.expired = 0
        self.alloc_failed = 0
        self.write_errors = 0
        self.busy = 0
        self.bytes_written = 0
        self.bytes_read = 0

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
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            logger.warning(msg, *args)

    def _expired(self, mtime: float) -> bool:
        return self._ttl is not None and time.time() - mtime > self._ttl

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._run(make_private_dirs, self._root)
        # Temporary files of writers that died (killed mid-write) are reaped in the background:
        # a large shared tree must not delay the start.
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        try:
            n = await self._run(reap_dead_writers, self._root)
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
        out = prepare(name, obj, 1 << 62)  # files are never split
        obj.ref_count_up()  # the job reads the block; it must outlive a cancelled caller
        try:
            stored = await self._run(self._write, self._root / name.relpath, out.head, out.payload,
                                     after=obj.ref_count_down)  # fmt: skip
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                self.write_errors += 1
                self._log("fs:// tier cannot write under %s: %s", self._root, exc)
                return False
            raise
        if stored:
            self.bytes_written += len(out.head) + out.payload.nbytes
        return True

    def _write(self, path: Path, head: bytes, payload: memoryview) -> bool:
        """Publish one record file; False when it was already there."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            pass
        else:
            if not self._expired(st.st_mtime):
                return False
            _unlink(path)
        make_private_dirs(path.parent)
        tmp = path.parent / f".{path.name}.{_host_tag()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            try:
                _write_all(fd, [memoryview(head), payload])
                if self._fsync == "data":
                    os.fdatasync(fd)
                elif self._fsync == "full":
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise
                if path.exists():
                    return False
                os.replace(tmp, path)
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
        path = self._root / name.relpath
        try:
            obj = await self._run(self._read, path, name.key, alloc, orphan=_release)
        except ForeignRecord:
            self.foreign += 1
            self._log("fs:// record %s holds another key; treated as a miss", path)
            return None
        except RecordError as exc:
            self.corrupt += 1
            self._log("fs:// record %s is corrupt (%s); removed", path, exc)
            return None
        except AllocationFailed:
            self.alloc_failed += 1
            return None
        except _Expired:
            self.expired += 1
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
                _unlink(path)
                raise _Expired()
            try:
                head = os.pread(fd, PROBE_LEN, 0)
                hlen = peek_header_len(head)
                if hlen > len(head):
                    head = os.pread(fd, hlen, 0)
                hdr = decode_header(head)
                if hdr.key != key:
                    raise ForeignRecord("record holds another key")
                if hdr.num_parts != 1 or st.st_size != hdr.header_len + hdr.payload_len:
                    raise RecordError("file size does not match its header")
            except ForeignRecord:
                raise
            except RecordError:
                _unlink(path)
                raise
            obj = allocate(hdr, alloc)
            try:
                dst = obj.byte_view()
                _read_all(fd, dst, hdr.header_len)
                if xxhash.xxh3_64_intdigest(dst) != hdr.checksum:
                    _unlink(path)
                    raise RecordError("payload checksum mismatch")
            except BaseException:
                obj.ref_count_down()
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
                elif fn.endswith(".tmp"):
                    _reap_temp(p, now)
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


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    bufs = [b.cast("B") if b.format != "B" else b for b in bufs if b.nbytes]
    while bufs:
        n = os.writev(fd, bufs)
        while n and bufs:
            first = bufs[0]
            if n >= first.nbytes:
                n -= first.nbytes
                bufs.pop(0)
            else:
                bufs[0] = first[n:]
                n = 0


def _read_all(fd: int, dst: memoryview, offset: int) -> None:
    done = 0
    total = dst.nbytes
    while done < total:
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise RecordError("file is shorter than its header says")
        done += n


def create(url: str, settings: ConnectorSettings) -> FSConnector:
    """Registry factory for ``fs://`` URLs."""
    parsed = parse_remote_url(url)
    if parsed.kind != "fs":
        raise ValueError(f"remote_url {redact(url)!r} is not an fs:// URL")
    return FSConnector(parsed, settings)
