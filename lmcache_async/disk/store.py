"""The blocking half of the disk tier: whole-file operations, the index and the budget.

:class:`DiskStore` is thread-safe and does blocking I/O: every public method is one executor
job of :class:`~lmcache_async.disk.tier.DiskBackend` (one job per whole file operation:
open, write or read, close), never run on the event loop. It owns

* the in-memory index (digest -> file bytes, least recently used first) under ``_ilock``;
* the shared byte budget (:class:`~lmcache_async.disk.budget.DirBudget`); the lock
  order is directory lock -> index lock;
* the write stop/resume state and the counters reported by ``stats()``.

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

import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from lmcache_async.disk.budget import (
    DirBudget,
    EntryFile,
    Ledger,
    Repairs,
    ShardListing,
    list_shard,
)
from lmcache_async.disk.layout import (
    ENTRY_SUFFIX,
    NUM_SHARDS,
    ensure_dir,
    entry_key,
    entry_path,
    fsync_dir,
    key_digest,
    publish_noreplace,
    reap_temp,
    shard_name,
    tmp_name,
    write_all,
)
from lmcache_async.encryption import new_buffer
from lmcache_async.lru import LruIndex
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.read_sinks import ReadSink
from lmcache_async.record_files import payload_problem, payload_problem_views, read_header, verified_header
from lmcache_async.record_sections import SEAL_SECTION_LEN
from lmcache_async.records import (
    ForeignSeal,
    RecordError,
    RecordHeader,
    encode_header,
    header_length,
    payload_checksum,
)
from lmcache_async.tiers import Allocate, RemovalReason

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

logger = logging.getLogger("lmcache_async.disk.tier")

FsyncPolicy = Literal["none", "data", "full"]

WRITE_STOP_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
"""Errors that stop writes for a back-off (disk full, quota, read-only, permission, too big)."""
_TOUCH_AFTER_S = 60.0  # refresh a file's mtime on read at most this often
_PUBLISH_TRIES = 4  # publish attempts of one write, each after a damaged record at its name went
_LOG_EVERY_S = 5.0

# outcomes of write()
STORED = "stored"
EXISTS = "exists"
NO_SPACE = "no_space"
FAILED = "failed"

COUNTERS = (
    "evictions",
    "corrupt",
    "vanished",
    "write_errors",
    "writes_refused",
    "no_space",
    "read_errors",
    "alloc_failures",
    "tmp_reaped",
    "stored",
    "read_hits",
    "read_mismatch",
    "foreign_key",
)
_SKIP = "skip"  # a payload reader declined the record (see DiskStore._read_record)


class DiskStore:
    """Blocking, thread-safe file operations over one disk-tier directory (see the module
    docstring). ``write_retry_s`` is the first back-off after writes stopped on a storage error
    (doubling up to ``write_retry_max_s``)."""

    def __init__(
        self,
        root: str,
        budget_bytes: int,
        *,
        fsync: FsyncPolicy = "none",
        write_retry_s: float = 1.0,
        write_retry_max_s: float = 30.0,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.on_removed: Callable[[list[str], RemovalReason], None] | None = None
        """Told the key strings of entries the store dropped on its own and why: budget
        evictions (EVICTED), files found deleted behind its back (DELETED), records found
        damaged and deleted (DAMAGED). Called on the thread that found them, possibly under the
        directory lock: it must be quick and must not call back into the store. Only entries
        whose key is known are reported (kept in the index, else read from the record header)."""
        self.cipher = cipher
        """Seals written records and opens read ones (None: plain records only)."""
        self._key_id = cipher.key_id if cipher is not None else None
        self.fsync: FsyncPolicy = fsync
        self._budget = DirBudget(root)
        # digest -> its key string when this process wrote or read it (None: found by the scan;
        # the record header names it), weighted by the file's bytes, LRU first
        self._index: LruIndex[bytes, str | None] = LruIndex()
        self._ilock = threading.Lock()
        self._scan_removed: set[bytes] | None = None
        self._scan_cleared = False
        self._evict_cursor = 0
        self.closed = False
        self._log = RateLimitedLog(logger, _LOG_EVERY_S)
        self._retry_base = write_retry_s
        self._retry_max = write_retry_max_s
        self._w_lock = threading.Lock()
        self._w_stopped = False
        self._w_backoff = 0.0
        self._w_retry_at = 0.0
        self._clock = threading.Lock()
        self._c: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # ---- small helpers ---------------------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (thread-safe)."""
        with self._clock:
            self._c[name] += n

    def warn(self, category: str, msg: str, *args: Any) -> None:
        """Log a warning, at most one per ``category`` every few seconds (thread-safe)."""
        self._log.warning(msg, *args, key=category)

    def counters(self) -> dict[str, int]:
        with self._clock:
            return dict(self._c)

    @property
    def budget(self) -> DirBudget:
        return self._budget

    @property
    def writes_stopped(self) -> bool:
        return self._w_stopped

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, digest: bytes) -> bool:
        """Index membership (lock-free; any thread)."""
        return digest in self._index

    def begin_scan(self) -> None:
        """Remember removals from now on, so a scan does not re-add what was removed meanwhile."""
        with self._ilock:
            self._scan_removed = set()
            self._scan_cleared = False

    def abort_scan(self) -> None:
        with self._ilock:
            self._scan_removed = None
            self._scan_cleared = False

    def close(self) -> None:
        self.closed = True
        self._budget.close()

    def _path(self, digest: bytes) -> str:
        return entry_path(self.root, digest)

    def _report(self, kstrs: list[str], reason: RemovalReason) -> None:
        """Hand ``kstrs`` to :attr:`on_removed` (nothing for none; its errors are dropped)."""
        listener = self.on_removed
        if listener is None or not kstrs:
            return
        try:
            listener(kstrs, reason)
        except Exception:  # pragma: no cover - a listener must not break the store
            logger.debug("disk tier: removal listener failed", exc_info=True)

    def _note_removed(self, digest: bytes) -> None:
        """Forget ``digest`` (index lock NOT held by the caller)."""
        with self._ilock:
            self._index.pop(digest)
            if self._scan_removed is not None:
                self._scan_removed.add(digest)

    def _note_present(self, digest: bytes, size: int, still_there: Callable[[], bool], kstr: str) -> None:
        """Index ``digest`` under its key string ``kstr`` (most recently used) unless its file
        was deleted meanwhile.

        ``still_there`` looks at the file again *after* the insertion: a deletion racing this
        either comes later and forgets the entry itself (every deletion unlinks first, then
        forgets), or has unlinked already and is seen here. At worst a record published again
        in between drops out of the index, which only costs a lookup an ``os.stat``.
        """
        with self._ilock:
            self._index.put(digest, kstr, size)
            if self._scan_removed is not None:
                self._scan_removed.discard(digest)
        try:
            there = still_there()
        except OSError:
            there = False
        if not there:
            self._note_removed(digest)

    # ---- write stop / resume ------------------------------------------------------------------
    def writes_allowed(self) -> bool:
        return not self._w_stopped or time.monotonic() >= self._w_retry_at

    def _write_failed(self, exc: OSError, what: str) -> None:
        self.count("write_errors")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the filesystem (not the budget) is full
            self.count("no_space")
        if exc.errno not in WRITE_STOP_ERRNOS:
            self.warn("write", "disk tier: %s failed: %s", what, exc)
            return
        with self._w_lock:
            first = not self._w_stopped
            now = time.monotonic()
            if first:
                self._w_backoff = self._retry_base
            elif now >= self._w_retry_at:  # a retry after the back-off failed: back off longer
                self._w_backoff = min(self._w_backoff * 2, self._retry_max)
            else:  # one more write that was already in flight when writes stopped
                return
            self._w_stopped = True
            self._w_retry_at = now + self._w_backoff
        if first:
            logger.warning(
                "disk tier %s: writes stopped (%s); reads go on, writes are retried after a back-off",
                self.root,
                exc,
            )

    def _write_ok(self) -> None:
        if not self._w_stopped:
            return
        with self._w_lock:
            was = self._w_stopped
            self._w_stopped = False
            self._w_backoff = 0.0
        if was:
            logger.warning("disk tier %s: writes resumed", self.root)

    # ---- removal primitives (directory lock held) ----------------------------------------------
    def _unlink_entry(
        self,
        led: Ledger,
        digest: bytes,
        expect_ino: int | None = None,
        *,
        repairs: Repairs | None = None,
    ) -> int | None:
        """Delete the entry file of ``digest`` (only if it is inode ``expect_ino`` when given);
        bytes freed, or None when nothing was deleted. The accounting follows.

        ``repairs``: the caller knew the file (an indexed entry). If it is already gone, it was
        deleted behind the tier's back (or by another process) and the accounting may still
        count it: its shard is recounted (see :class:`Repairs`).
        """
        path = self._path(digest)
        missing = False

        def fn() -> tuple[int, int]:
            nonlocal missing
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                missing = True
                return 0, 0
            if expect_ino is not None and st.st_ino != expect_ino:
                return 0, 0  # replaced by a fresh record since the caller looked
            try:
                os.unlink(path)
            except FileNotFoundError:
                missing = True
                return 0, 0
            return -st.st_size, -1

        db, df = led.change(digest[0], fn)
        self._note_removed(digest)
        if df:
            return -db
        if missing and repairs is not None:
            repairs.shard(led, digest[0])
        return None

    def _pop_victim(self, exclude: bytes | None) -> tuple[bytes, str | None] | None:
        with self._ilock:
            return self._index.pop_oldest(None if exclude is None else lambda d, _kstr: d == exclude)

    def _evict_unindexed(
        self, led: Ledger, need: int, exclude: bytes | None, repairs: Repairs, evicted: list[str]
    ) -> bool:
        """Evict files this process has not indexed (oldest mtime first, shard by shard) until
        ``need`` more bytes fit in the budget, appending the key each record header names to
        ``evicted``. A shard whose accounting claims more bytes than its files hold (files
        deleted behind the tier's back) is recounted instead of paying for the missing bytes
        with real entries. True when anything was evicted or recounted."""
        budget = self.budget_bytes
        progress = False
        for _ in range(NUM_SHARDS):
            if led.total_bytes + need <= budget:
                break
            shard = self._evict_cursor
            self._evict_cursor = (shard + 1) % NUM_SHARDS
            listing = list_shard(self.root, shard)
            if sum(e.size for e in listing.entries) < led.shard(shard)[0]:
                fresh = repairs.shard(led, shard)
                if fresh is not None:
                    listing = fresh
                    progress = True
                    if led.total_bytes + need <= budget:
                        break
            for e in sorted(listing.entries, key=lambda e: e.mtime_ns):
                if led.total_bytes + need <= budget:
                    return True
                if e.digest == exclude:
                    continue
                kstr = entry_key(self.root, e.digest)
                if self._unlink_entry(led, e.digest, e.ino) is not None:
                    self.count("evictions")
                    progress = True
                    if kstr is not None:
                        evicted.append(kstr)
        return progress

    def _make_room(self, led: Ledger, need: int, exclude: bytes | None) -> bool:
        """Evict (LRU) until ``need`` more bytes fit in the budget; False when they cannot.

        Self-repairing (:class:`Repairs`): an indexed victim whose file is already gone has its
        shard recounted, and when nothing at all can be evicted while the accounting says the
        directory is over budget, every shard is recounted once before giving up (files deleted
        behind the tier's back must not refuse writes until the next start)."""
        budget = self.budget_bytes
        if need > budget:
            return False
        repairs = Repairs()
        evicted: list[str] = []
        vanished: list[str] = []
        try:
            while led.total_bytes + need > budget:
                victim = self._pop_victim(exclude)
                if victim is None:
                    if self._evict_unindexed(led, need, exclude, repairs, evicted) or repairs.everything(led):
                        continue
                    return False
                digest, kstr = victim
                if kstr is None:  # found by the scan: its record header names it
                    kstr = entry_key(self.root, digest)
                if self._unlink_entry(led, digest, repairs=repairs) is not None:
                    self.count("evictions")
                    if kstr is not None:
                        evicted.append(kstr)
                elif kstr is not None:  # its file was already gone
                    vanished.append(kstr)
            return True
        finally:
            self._report(evicted, RemovalReason.EVICTED)
            self._report(vanished, RemovalReason.DELETED)

    def _discard_corrupt(self, digest: bytes, ino: int, why: str, kstr: str | None = None) -> None:
        """Count and delete a damaged file (unless a fresh record replaced it meanwhile); the
        key ``kstr`` (when known) is reported DAMAGED unless a fresh record replaced it."""
        self.count("corrupt")
        self.warn("corrupt", "disk tier: %s is damaged (%s); deleted", self._path(digest), why)
        try:
            with self._budget.locked() as led:
                self._unlink_entry(led, digest, ino)
                led.recount(digest[0])  # its size may have changed behind the accounting
        except OSError as exc:  # read-only filesystem: it stays, and stays a miss
            self._note_removed(digest)
            self.warn("corrupt-rm", "disk tier: cannot delete a damaged file: %s", exc)
        if kstr is not None and not _replaced(self._path(digest), ino):
            self._report([kstr], RemovalReason.DAMAGED)

    def forget_vanished(self, digest: bytes, kstr: str | None = None) -> bool:
        """A lookup found no file for ``digest`` (the entry of ``kstr``, when the caller knows
        it): drop its index entry (any thread, no I/O).

        True when it was indexed (counted as ``vanished``, its key reported DELETED): the file
        was deleted behind the tier's back and the accounting may still count it, so the caller
        has its shard recounted (:meth:`repair_shard`)."""
        with self._ilock:
            known = digest in self._index
            if known:
                kstr = self._index.pop(digest) or kstr
                if self._scan_removed is not None:
                    self._scan_removed.add(digest)
        if known:
            self.count("vanished")
            self._report([kstr] if kstr is not None else [], RemovalReason.DELETED)
        return known

    def repair_shard(self, shard: int) -> None:
        """Recount ``shard`` (all of them when it counted bytes of missing files; see
        :class:`Repairs`) under the directory lock. Blocking; failures are ignored (the next
        holder of the lock, or the next start, repairs it)."""
        try:
            with self._budget.locked() as led:
                Repairs().shard(led, shard)
        except OSError:
            pass

    def _vanished(self, digest: bytes, kstr: str) -> None:
        """A file the index knew is gone: forget it and repair the shard's accounting."""
        if self.forget_vanished(digest, kstr):
            self.repair_shard(digest[0])

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

    def remove(self, digest: bytes) -> bool:
        """Delete the entry; True when a file was deleted. An indexed entry whose file is gone
        has its shard recounted (it was deleted behind the tier's back)."""
        repairs = Repairs() if digest in self._index else None
        with self._budget.locked() as led:
            return self._unlink_entry(led, digest, repairs=repairs) is not None

    def clear(self) -> None:
        for shard in range(NUM_SHARDS):
            with self._budget.locked() as led:
                listing = list_shard(self.root, shard)
                if listing.entries or led.shard(shard) != (0, 0):
                    kstrs = self._keys_of(listing) if self.on_removed is not None else []
                    led.delete_listed(listing)
                    self._report(kstrs, RemovalReason.DELETED)
        with self._ilock:
            self._index.clear()
            if self._scan_removed is not None:
                self._scan_removed = set()
                self._scan_cleared = True

    def _keys_of(self, listing: ShardListing) -> list[str]:
        """The key strings of the entries in ``listing`` (from the index, else from each record
        header; entries whose key cannot be read are left out)."""
        with self._ilock:
            known = [self._index.get(e.digest) for e in listing.entries]
        out = []
        for e, kstr in zip(listing.entries, known, strict=True):
            kstr = kstr if kstr is not None else entry_key(self.root, e.digest)
            if kstr is not None:
                out.append(kstr)
        return out

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

    def evict_to_budget(self) -> None:
        with self._budget.locked() as led:
            self._make_room(led, 0, None)


def _exists(path: str) -> bool:
    try:
        os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _replaced(path: str, ino: int) -> bool:
    """True when ``path`` now holds another file than inode ``ino`` (a fresh record)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino != ino
    except OSError:
        return False


def _linked(fd: int) -> bool:
    """False once the open file was unlinked (by anyone, any process)."""
    return os.fstat(fd).st_nlink > 0
