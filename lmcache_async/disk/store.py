"""The blocking half of the disk tier: whole-file operations, the index and the budget.

:class:`DiskStore` is thread-safe and does blocking I/O: every public method is one executor
job of :class:`~lmcache_async.disk.tier.DiskBackend` (one job per whole file operation:
open, write or read, close), never run on the event loop. It owns

* the in-memory index (digest -> file bytes, least recently used first) under ``_ilock``;
* the shared byte budget (:class:`~lmcache_async.disk.budget.DirBudget`); the lock
  order is directory lock -> index lock;
* the write stop/resume state and the counters reported by ``stats()``.

This module holds the whole-file operations (write, read, start-up scan); the index, counters
and write stop/resume state are :mod:`.store_state`, deletion, eviction and accounting repair
:mod:`.store_removal`.

Nothing here trusts a file: every read checks the record (:mod:`lmcache_async.records`), and a
damaged, truncated or foreign file is deleted and counted. A write that finds a record already at
its key's name checks it the same way (:meth:`DiskStore.write`): a valid one is kept, a damaged or
foreign one is deleted (counted) and replaced, so a put always leaves a readable record. Nor
does it trust the accounting blindly: files deleted behind the tier's back are noticed by
lookups, reads and eviction and their shards recounted (:class:`Repairs`), so writes never
stay refused until the next start; and a read or write racing a removal never leaves an index
entry without a file (:meth:`DiskStore._note_present`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence

from lmcache_async.disk.budget import EntryFile, list_shard
from lmcache_async.disk.layout import (
    ENTRY_SUFFIX,
    ensure_dir,
    fsync_dir,
    key_digest,
    publish_noreplace,
    reap_temp,
    shard_name,
    tmp_name,
    write_all,
)
from lmcache_async.disk.store_removal import StoreRemoval
from lmcache_async.disk.store_state import (
    COUNTERS,
    EXISTS,
    FAILED,
    NO_SPACE,
    STORED,
    WRITE_STOP_ERRNOS,
    FsyncPolicy,
)
from lmcache_async.encryption import new_buffer
from lmcache_async.lru import LruIndex
from lmcache_async.memory import MemoryObj
from lmcache_async.read_sinks import ReadSink
from lmcache_async.records import (
    ForeignSeal,
    RecordError,
    RecordHeader,
    encode_header,
    header_length,
    payload_checksum,
)
from lmcache_async.records.files import payload_problem, payload_problem_views, read_header, verified_header
from lmcache_async.records.sections import SEAL_SECTION_LEN
from lmcache_async.tiers import Allocate

__all__ = [
    "COUNTERS",
    "EXISTS",
    "FAILED",
    "NO_SPACE",
    "STORED",
    "WRITE_STOP_ERRNOS",
    "DiskStore",
    "FsyncPolicy",
]

_TOUCH_AFTER_S = 60.0  # refresh a file's mtime on read at most this often
_PUBLISH_TRIES = 4  # publish attempts of one write, each after a damaged record at its name went
_SKIP = "skip"  # a payload reader declined the record (see DiskStore._read_record)


class DiskStore(StoreRemoval):
    """Blocking, thread-safe file operations over one disk-tier directory (see the module
    docstring). ``write_retry_s`` is the first back-off after writes stopped on a storage error
    (doubling up to ``write_retry_max_s``)."""

    # ---- whole-file operations (executor threads) ------------------------------------------------
    def write(self, digest: bytes, kstr: str, obj: MemoryObj) -> str:
        hexd = digest.hex()
        sdir = f"{self.root}/{hexd[:2]}"
        path = f"{sdir}/{hexd}{ENTRY_SUFFIX}"
        try:  # a re-put, or another process wrote it: keep it if it is a valid record
            os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._write_failed(exc, "stat")
            return FAILED
        else:
            found = self._check_existing(digest, kstr, path)
            if found is not None:
                return found
        try:
            bufs = self._encode(kstr, obj)
        except ValueError as exc:  # a key or shape the record format cannot hold
            self.count("write_errors")
            self.warn("encode", "disk tier: cannot store %r: %s", kstr[:200], exc)
            return FAILED
        total = sum(memoryview(b).nbytes for b in bufs)
        tmp = f"{sdir}/{tmp_name(digest, hexd)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        status = FAILED
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                if ensure_dir(sdir) and self.fsync == "full":
                    fsync_dir(self.root)
                fd = os.open(tmp, flags, 0o600)
            try:
                write_all(fd, bufs)
                if self.fsync != "none":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            for _ in range(_PUBLISH_TRIES):
                status = self._publish(digest, tmp, path, total)
                if status != EXISTS:
                    break
                # Another writer published first: first valid writer wins, a damaged one goes.
                found = self._check_existing(digest, kstr, path)
                if found is not None:
                    status = found
                    break
            else:  # a damaged record reappeared at the name every time
                self.count("write_errors")
                self.warn("write", "disk tier: cannot publish %s: damaged records keep appearing", path)
                status = FAILED
            if status == STORED and self.fsync == "full":
                fsync_dir(sdir)
        except OSError as exc:
            self._write_failed(exc, "write")
            status = FAILED
        finally:
            if status != STORED:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        if status == STORED:
            self._note_present(digest, total, functools.partial(_exists, path), kstr)
            self.count("stored")
            self._write_ok()
        elif status == NO_SPACE:
            self.count("no_space")
        return status

    def _encode(self, kstr: str, obj: MemoryObj) -> tuple[bytes | memoryview, ...]:
        """The record of ``obj``: header and the pool block's view, or (sealed) one new buffer."""
        view = obj.byte_view()
        if self.cipher is None:
            return encode_header(kstr, obj.shape, obj.dtype, obj.fmt, payload_checksum(view)), view
        shape = tuple(obj.shape)
        hlen = header_length(len(kstr.encode("utf-8")), len(shape), SEAL_SECTION_LEN)
        seal, buf = self.cipher.seal(kstr, shape, obj.dtype, obj.fmt, view, reserve=hlen)
        buf[:hlen] = encode_header(kstr, shape, obj.dtype, obj.fmt, payload_checksum(buf[hlen:]), seal=seal)
        return (buf,)

    def _land_sealed(self, fd: int, hdr: RecordHeader, dst: Sequence[memoryview]) -> str | None:
        """Read a sealed payload into a scratch buffer, check it and decrypt it into ``dst``
        (views holding ``hdr.plain_len`` bytes in all): what is wrong, or None."""
        assert self.cipher is not None  # the header passed the key-id check
        stored = new_buffer(hdr.payload_len)
        problem = payload_problem(fd, hdr, stored)
        if problem is not None:
            return problem
        whole = dst[0] if len(dst) == 1 else new_buffer(hdr.plain_len)
        try:
            self.cipher.open_into(hdr, stored, whole)
        except RecordError as exc:
            return str(exc)
        if len(dst) > 1:
            off = 0
            for v in dst:
                v[:] = whole[off : off + v.nbytes]
                off += v.nbytes
        return None

    def _foreign_seal(self, path: str, exc: RecordError) -> None:
        self.count("foreign_key")
        self.warn("foreign_key", "disk tier: %s is not for this tier's key (%s); kept", path, exc)

    def _publish(self, digest: bytes, tmp: str, path: str, total: int) -> str:
        """Rename the written record into place, then account it (see
        :meth:`DirBudget.generation`): the rename, which can stall on a busy journal, runs
        outside the directory lock. Over budget, older entries are evicted; if nothing else can
        go, the new entry itself is dropped. If the accounting fails after the rename (the lock
        or a repair under it raised), the record is deleted again and its shard recounted at
        this process's next lock, so the budget never keeps an uncounted file."""
        budget = self._budget
        gen = budget.generation()
        if gen is None:  # first use: map the accounting file
            budget.acquire()
            budget.release()
            gen = budget.generation()
        if not publish_noreplace(tmp, path):
            return EXISTS  # another writer published this key first
        shard = digest[0]
        counted = False
        try:
            if gen is not None and budget.try_account_publish(shard, total, gen, self.budget_bytes):
                return STORED
            led = budget.acquire()
            try:
                if budget.generation() == gen:
                    led.add(shard, total, 1)
                else:  # a recount ran meanwhile and may have counted this file already
                    led.recount(shard)
                counted = True
                if self._make_room(led, 0, digest):
                    return STORED
                self._unlink_entry(led, digest)
                return NO_SPACE
            finally:
                budget.release()
        except Exception:
            if not counted:
                self._drop_uncounted(digest, path)
            raise

    def _drop_uncounted(self, digest: bytes, path: str) -> None:
        """Delete a published record whose accounting failed; its shard is recounted at the
        next lock (a recount may have counted it meanwhile, or the deletion may fail)."""
        try:
            os.unlink(path)
        except OSError:
            pass
        self._budget.recount_later(digest[0])

    def _check_existing(self, digest: bytes, kstr: str, path: str) -> str | None:
        """Check the record a write found at its key's name, as a read would (header, key, size,
        payload checksum). ``EXISTS`` when it is valid: it is kept (and indexed). None when there
        is no record there any more: a damaged or foreign one was deleted (counted; unless a fresh
        record replaced it meanwhile, which the caller's publish then meets), so the caller writes
        its own. ``FAILED`` when it cannot be read (EACCES, EIO, ...): it is kept, unverified, and
        the write reports failure (``read_errors``)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self.count("read_errors")
            self.warn("read", "disk tier: cannot open %s: %s", path, exc)
            return FAILED
        bad: tuple[int, str] | None = None
        try:
            st = os.fstat(fd)
            try:
                hdr = verified_header(fd, st.st_size, kstr, key_id=self._key_id)
            except ForeignSeal as exc:  # another key's record: kept, and this write fails
                self._foreign_seal(path, exc)
                return FAILED
            except RecordError as exc:
                bad = (st.st_ino, str(exc))
                return None
            # A scratch buffer: the payload is only checked, never kept.
            if hdr.seal is not None:
                bad_payload = self._land_sealed(fd, hdr, [memoryview(bytearray(hdr.plain_len))])
            else:
                bad_payload = payload_problem(fd, hdr, memoryview(bytearray(hdr.payload_len)))
            if bad_payload is not None:
                bad = (st.st_ino, bad_payload)
                return None
            self._note_present(digest, st.st_size, functools.partial(_linked, fd), kstr)
            return EXISTS
        except OSError as exc:
            self.count("read_errors")
            self.warn("read", "disk tier: reading %s failed: %s", path, exc)
            return FAILED
        finally:
            os.close(fd)
            if bad is not None:
                self._discard_corrupt(digest, *bad, kstr)

    def _read_record(self, digest: bytes, kstr: str, land: Callable[[int, RecordHeader], str | None]) -> bool:
        """Open the entry's file, check its header against ``kstr`` and let ``land(fd, header)``
        read the payload: it returns what is wrong with the payload (the file is then deleted
        as corrupt), None when it is whole, or :data:`_SKIP` when it declined to read it (not a
        hit, not damage). True for a hit (counted, the entry touched)."""
        path = self._path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._vanished(digest, kstr)
            return False
        except OSError as exc:
            self.count("read_errors")
            self.warn("read", "disk tier: cannot open %s: %s", path, exc)
            return False
        bad: tuple[int, str] | None = None
        try:
            st = os.fstat(fd)
            try:
                hdr = verified_header(fd, st.st_size, kstr, key_id=self._key_id)
            except ForeignSeal as exc:
                self._foreign_seal(path, exc)
                return False
            except RecordError as exc:
                bad = (st.st_ino, str(exc))
                return False
            problem = land(fd, hdr)
            if problem == _SKIP:
                return False
            if problem is not None:
                bad = (st.st_ino, problem)
                return False
            if time.time() - st.st_mtime > _TOUCH_AFTER_S:
                try:
                    os.utime(fd)  # keeps the LRU order across restarts and processes
                except OSError:
                    pass
            self._note_present(digest, st.st_size, functools.partial(_linked, fd), kstr)
            self.count("read_hits")
            return True
        except OSError as exc:
            self.count("read_errors")
            self.warn("read", "disk tier: reading %s failed: %s", path, exc)
            return False
        finally:
            os.close(fd)
            if bad is not None:
                self._discard_corrupt(digest, *bad, kstr)

    def read(self, digest: bytes, kstr: str, alloc: Allocate) -> MemoryObj | None:
        """The verified record in a buffer from ``alloc`` (the caller's reference), or None."""
        got: list[MemoryObj] = []

        def land(fd: int, hdr: RecordHeader) -> str | None:
            obj = alloc(hdr.shape, hdr.dtype, hdr.fmt)
            if obj is None:
                self.count("alloc_failures")
                return _SKIP
            got.append(obj)
            if hdr.seal is not None:
                return self._land_sealed(fd, hdr, [obj.byte_view()])
            return payload_problem(fd, hdr, obj.byte_view())

        ok = False
        try:
            ok = self._read_record(digest, kstr, land)
        finally:
            if got and not ok:
                got[0].ref_count_down()
        return got[0] if ok else None

    def read_into(self, digest: bytes, kstr: str, sink: ReadSink) -> bool:
        """Read the verified payload straight into ``sink`` (caller-owned memory; any thread).
        True for a hit; False for a miss, a record of another shape or dtype (counted as
        ``read_mismatch``, kept), or damage (the file is deleted, counted): the sink's bytes
        are then not to be used."""

        def land(fd: int, hdr: RecordHeader) -> str | None:
            if not sink.fits(hdr.shape, hdr.dtype):
                self.count("read_mismatch")
                return _SKIP
            if hdr.seal is not None:
                return self._land_sealed(fd, hdr, sink.views())
            return payload_problem_views(fd, hdr, sink.views())

        return self._read_record(digest, kstr, land)

    def scan_group(self, shards: list[int]) -> list[tuple[int, bytes, int]]:
        """Recount ``shards`` exactly (under the lock), reap dead writers' temporary files and
        read every record header; ``(mtime_ns, digest, size)`` of the valid entries."""
        created = False
        for s in shards:  # up front, so writes never pay for a mkdir
            try:
                created = ensure_dir(f"{self.root}/{shard_name(s)}") or created
            except OSError:
                break
        if created and self.fsync == "full":
            fsync_dir(self.root)
        try:
            with self._budget.locked() as led:
                listings = led.recount_many(shards)
        except OSError:  # no accounting possible (read-only filesystem): index what is there
            listings = [list_shard(self.root, s) for s in shards]
        now = time.time()
        out: list[tuple[int, bytes, int]] = []
        for listing in listings:
            sdir = f"{self.root}/{shard_name(listing.shard)}"
            for name, mtime in listing.tmps:
                if reap_temp(f"{sdir}/{name}", mtime, now):
                    self.count("tmp_reaped")
            for e in listing.entries:
                if self.closed:
                    break
                if self._check_header(f"{sdir}/{e.name}", e):
                    out.append((e.mtime_ns, e.digest, e.size))
        return out

    def _check_header(self, path: str, e: EntryFile) -> bool:
        """True when the file holds a well-formed record of the key its name stands for and has
        the listed size; a damaged file is discarded (unless it was replaced since the listing)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        problem = None
        kstr: str | None = None
        try:
            hdr = read_header(fd)
            if key_digest(hdr.key) != e.digest:
                problem = "file name does not match the key it holds"
            elif e.size != hdr.total_len:
                kstr = hdr.key
                problem = "file is truncated" if e.size < hdr.total_len else "trailing bytes"
        except RecordError as exc:
            problem = str(exc)
        except OSError:
            return False
        finally:
            os.close(fd)
        if problem is not None:
            self._discard_corrupt(e.digest, e.ino, problem, kstr)
            return False
        return True

    def merge_scan(self, found: list[tuple[int, bytes, int]]) -> int:
        found.sort()
        with self._ilock:
            removed = self._scan_removed or set()
            cleared = self._scan_cleared
            self._scan_removed = None
            self._scan_cleared = False
            merged: LruIndex[bytes, str | None] = LruIndex()
            if not cleared:
                for _mt, d, size in found:
                    if d not in removed:
                        merged.put(d, None, size)
            old = self._index
            for d, kstr in old.items():  # touched since start: most recent
                merged.put(d, kstr, old.size(d) or 0)
            self._index = merged
            return len(merged)


def _exists(path: str) -> bool:
    try:
        os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _linked(fd: int) -> bool:
    """False once the open file was unlinked (by anyone, any process)."""
    return os.fstat(fd).st_nlink > 0
