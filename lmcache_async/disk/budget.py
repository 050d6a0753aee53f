"""The byte budget of a disk-tier directory, shared by every process that uses it.

One accounting file, ``<root>/.lmcache-disk.acct``, holds the directory's totals, per shard the
bytes and number of entry files, a "dirty" marker and a recount generation. It is mapped shared
(``mmap``): updates are memory stores that other processes see at once and that outlive a
killed writer. Every update happens while holding an exclusive ``flock`` on the file, in this
order: mark the shard dirty, store the shard's and the totals' new figures, clear the marker.
Whoever takes the lock and finds the marker set recounts that shard from the directory.

* Deleting entry files (eviction, ``remove``, ``clear``, corruption) happens inside that
  sequence (:meth:`Ledger.change`), so a kill at any point is repaired by the next holder.
* Publishing renames the record into place *outside* the lock (a rename can stall on a busy
  journal and every writer would queue behind it), then accounts it under the lock
  (:meth:`DirBudget.try_account_publish` / :meth:`Ledger.add`) — unless the recount generation
  moved since before the rename, in which case a recount may have counted the file already and
  the shard is recounted instead.
* Changes made behind the tier's back (a user's ``rm``) are repaired when noticed, and every
  process start recounts every shard.

Layout (little-endian): ``magic "LMCDACCT"``, ``u32 version``, ``i32 dirty`` (-1 none, -2 all,
else a shard), ``u64 total bytes``, ``u64 total files``, ``u64 generation``, 24 reserved bytes,
then 256 x (``u64 bytes``, ``u64 files``). Temporary files are not counted. See
``docs/formats.md``. Blocking: call it from executor threads only.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from lmcache_async.disk.layout import (
    ACCT_NAME,
    FILE_MODE,
    NUM_SHARDS,
    TMP_SUFFIX,
    parse_entry_name,
    shard_name,
)

__all__ = [
    "ACCT_MAGIC",
    "ACCT_SIZE",
    "ACCT_VERSION",
    "DIRTY_ALL",
    "DIRTY_NONE",
    "AccountingFormatError",
    "DirBudget",
    "EntryFile",
    "Ledger",
    "Repairs",
    "ShardListing",
    "list_shard",
    "read_accounting",
]

ACCT_MAGIC = b"LMCDACCT"
ACCT_VERSION = 1
_HEAD = struct.Struct("<8sIiQQQ")  # magic, version, dirty, total bytes, total files, generation
_TOTALS = struct.Struct("<QQ")
_TOTALS_OFF = 16
_DIRTY = struct.Struct("<i")
_DIRTY_OFF = 12
_GEN = struct.Struct("<Q")
_GEN_OFF = 32
_STATE = struct.Struct("<iQQQ")  # dirty, total bytes, total files, generation (from offset 12)
_HEAD_LEN = 64
_SLOT = struct.Struct("<QQ")
_SLOTS = struct.Struct(f"<{2 * NUM_SHARDS}Q")
ACCT_SIZE = _HEAD_LEN + _SLOTS.size
DIRTY_NONE = -1
DIRTY_ALL = -2


class AccountingFormatError(RuntimeError):
    """The accounting file was written by a newer, unknown format version."""


class EntryFile(NamedTuple):
    """One entry file as a directory listing saw it."""

    name: str
    size: int
    mtime_ns: int
    ino: int
    digest: bytes


@dataclass
class ShardListing:
    """What a listing saw in one shard: entry files and temporary files ``(name, mtime)``."""

    shard: int
    entries: list[EntryFile] = field(default_factory=list)
    tmps: list[tuple[str, float]] = field(default_factory=list)


def list_shard(root: str, shard: int) -> ShardListing:
    """Entry and temporary files of one shard directory (missing directory: empty)."""
    out = ShardListing(shard)
    try:
        it = os.scandir(f"{root}/{shard_name(shard)}")
    except (FileNotFoundError, NotADirectoryError):
        return out
    with it:
        for de in it:
            name = de.name
            if name[0] == ".":
                if name.endswith(TMP_SUFFIX):
                    try:
                        out.tmps.append((name, de.stat(follow_symlinks=False).st_mtime))
                    except FileNotFoundError:
                        pass
                continue
            digest = parse_entry_name(name)
            if digest is None:
                continue
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.entries.append(EntryFile(name, st.st_size, st.st_mtime_ns, st.st_ino, digest))
    return out


class Ledger:
    """The accounting state while the directory lock is held (see :meth:`DirBudget.locked`).

    Reads and writes go to the shared mapping of the accounting file: no system call, and a
    process killed between two stores leaves the dirty marker for the next holder to repair.
    """

    def __init__(self, owner: DirBudget, mm: mmap.mmap) -> None:
        self._owner = owner
        self._mm = mm

    @property
    def total_bytes(self) -> int:
        """Bytes of every entry file in the directory."""
        return int(_TOTALS.unpack_from(self._mm, _TOTALS_OFF)[0])

    @property
    def total_files(self) -> int:
        """Number of entry files in the directory."""
        return int(_TOTALS.unpack_from(self._mm, _TOTALS_OFF)[1])

    def shard(self, shard: int) -> tuple[int, int]:
        """``(bytes, files)`` of one shard."""
        b, f = _SLOT.unpack_from(self._mm, _HEAD_LEN + _SLOT.size * shard)
        return int(b), int(f)

    def _set_dirty(self, value: int) -> None:
        _DIRTY.pack_into(self._mm, _DIRTY_OFF, value)

    def change(self, shard: int, fn: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        """Run ``fn`` (which creates or deletes entry files in ``shard`` and returns the change
        ``(bytes, files)`` it made) crash-safely; returns what ``fn`` returned.

        If ``fn`` raises, the shard is recounted before the exception propagates.
        """
        self._set_dirty(shard)
        try:
            db, df = fn()
        except BaseException:
            self.recount(shard)
            raise
        self._apply(shard, db, df)
        return db, df

    def add(self, shard: int, db: int, df: int) -> None:
        """Account a change made to ``shard`` outside this lock (a published record)."""
        self._set_dirty(shard)
        self._apply(shard, db, df)

    def _apply(self, shard: int, db: int, df: int) -> None:
        mm = self._mm
        off = _HEAD_LEN + _SLOT.size * shard
        b, f = _SLOT.unpack_from(mm, off)
        b += db
        f += df
        tb, tf = _TOTALS.unpack_from(mm, _TOTALS_OFF)
        tb += db
        tf += df
        if min(b, f, tb, tf) < 0:  # only if someone bypassed the lock: repair
            self.recount(shard)
        else:
            _SLOT.pack_into(mm, off, b, f)
            _TOTALS.pack_into(mm, _TOTALS_OFF, tb, tf)
            self._set_dirty(DIRTY_NONE)

    def delete_listed(self, listing: ShardListing) -> int:
        """Delete the entry files of ``listing`` (taken under this lock) crash-safely; how many
        were deleted."""
        sdir = f"{self._owner.root}/{shard_name(listing.shard)}"

        def fn() -> tuple[int, int]:
            db = df = 0
            for e in listing.entries:
                try:
                    os.unlink(f"{sdir}/{e.name}")
                except FileNotFoundError:
                    continue
                db -= e.size
                df -= 1
            return db, df

        return -self.change(listing.shard, fn)[1]

    def recount(self, shard: int, *, mark: bool = True) -> ShardListing:
        """Count the shard's entry files from the directory and store the figures.

        ``mark=False`` leaves the dirty marker and the totals alone (the caller recounts more
        and fixes the totals itself).
        """
        mm = self._mm
        if mark:
            self._set_dirty(shard)
        listing = list_shard(self._owner.root, shard)
        b = sum(e.size for e in listing.entries)
        f = len(listing.entries)
        _SLOT.pack_into(mm, _HEAD_LEN + _SLOT.size * shard, b, f)
        # After the listing: a writer that read the generation before renaming its file and
        # sees it changed cannot know whether the listing saw the file, so it recounts.
        _GEN.pack_into(mm, _GEN_OFF, (_GEN.unpack_from(mm, _GEN_OFF)[0] + 1) & 0xFFFF_FFFF_FFFF_FFFF)
        if mark:
            self._fix_totals()
            self._set_dirty(DIRTY_NONE)
        return listing

    def recount_many(self, shards: list[int]) -> list[ShardListing]:
        """:meth:`recount` of several shards, fixing the totals once."""
        self._set_dirty(DIRTY_ALL)  # a kill in the middle makes the next holder recount all
        out = [self.recount(s, mark=False) for s in shards]
        self._fix_totals()
        self._set_dirty(DIRTY_NONE)
        return out

    def _fix_totals(self) -> None:
        slots = _SLOTS.unpack_from(self._mm, _HEAD_LEN)
        _TOTALS.pack_into(self._mm, _TOTALS_OFF, sum(slots[0::2]), sum(slots[1::2]))


class Repairs:
    """Accounting repairs during one removal pass (under the directory lock).

    A shard found to count files that are gone (an indexed file missing, a listing holding
    fewer bytes than the accounting) is recounted, once per pass. If that recount really
    finds bytes counted for missing files, files were deleted behind the tier's back, and such
    files rarely go alone (``rm dir/*/*.lmc``): every shard is recounted once, so eviction
    never pays for missing bytes with real entries. A recount that changes nothing (another
    process deleted the file and accounted it) costs one listing.
    """

    def __init__(self) -> None:
        self.shards: set[int] = set()
        self.full = False

    def shard(self, led: Ledger, shard: int) -> ShardListing | None:
        """Recount ``shard`` (first time in this pass); its fresh listing, or None."""
        if self.full or shard in self.shards:
            return None
        self.shards.add(shard)
        before = led.shard(shard)[0]
        listing = led.recount(shard)
        if led.shard(shard)[0] < before:
            self.everything(led)
        return listing

    def everything(self, led: Ledger) -> bool:
        """Recount every shard (first time in this pass); False when done already."""
        if self.full:
            return False
        self.full = True
        led.recount_many(list(range(NUM_SHARDS)))
        return True


class DirBudget:
    """The shared accounting file of one directory and its lock. Thread-safe; blocking."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = f"{root}/{ACCT_NAME}"
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._closed = False
        self._tlock = threading.Lock()
        self._plock = threading.Lock()
        self._pending: set[int] = set()
        self.recovered_shards = 0
        """Shards recounted because a process died while changing them (or the file was new)."""
        try:
            self._open()
        except OSError:
            pass  # a read-only or full filesystem: retried by every locked() until it works

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)

    def close(self) -> None:
        """Close the accounting file (idempotent); :meth:`locked` raises OSError afterwards."""
        with self._tlock:
            self._closed = True
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    @property
    def usable(self) -> bool:
        """True when the accounting file is open (False on a read-only filesystem, say)."""
        return self._fd >= 0

    def _map(self) -> mmap.mmap:
        """Map the file, creating its contents first if it is new or not ours (lock held)."""
        fd = self._fd
        head = os.pread(fd, _HEAD.size, 0)
        if os.fstat(fd).st_size < ACCT_SIZE or head[:8] != ACCT_MAGIC:
            fresh = bytearray(ACCT_SIZE)
            _HEAD.pack_into(fresh, 0, ACCT_MAGIC, ACCT_VERSION, DIRTY_ALL, 0, 0, 0)
            os.ftruncate(fd, ACCT_SIZE)
            os.pwrite(fd, bytes(fresh), 0)
        else:
            version = _HEAD.unpack_from(head, 0)[1]
            if version != ACCT_VERSION:
                raise AccountingFormatError(
                    f"{self.path} has accounting format version {version}; this release reads version {ACCT_VERSION}"
                )
        # Blocks must exist before stores go through the mapping: a store into a hole of a
        # mapped file on a full filesystem would kill the process with SIGBUS.
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, ACCT_SIZE)
        return mmap.mmap(fd, ACCT_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def _reconcile(self, ledger: Ledger, mm: mmap.mmap) -> None:
        dirty = _DIRTY.unpack_from(mm, _DIRTY_OFF)[0]
        if dirty == DIRTY_NONE:
            return
        if 0 <= dirty < NUM_SHARDS:
            ledger.recount(dirty)
            self.recovered_shards += 1
            return
        # a new file, or a process died during a full recount
        ledger._set_dirty(DIRTY_ALL)
        for s in range(NUM_SHARDS):
            ledger.recount(s, mark=False)
        ledger._fix_totals()
        ledger._set_dirty(DIRTY_NONE)
        self.recovered_shards += NUM_SHARDS

    def recount_later(self, shard: int) -> None:
        """Have the next :meth:`acquire` of this process recount ``shard`` (any thread).

        For a change made to ``shard`` that could not be accounted under the lock (the lock
        itself failed): the file stays uncounted only until this process next holds the lock
        (or, at the latest, until the next start recounts everything)."""
        with self._plock:
            self._pending.add(shard)

    def _recount_pending(self, ledger: Ledger) -> None:
        if not self._pending:
            return
        with self._plock:
            todo = sorted(self._pending)
            self._pending.clear()
        for n, shard in enumerate(todo):
            try:
                ledger.recount(shard)
            except BaseException:
                with self._plock:
                    self._pending.update(todo[n:])
                raise

    def acquire(self) -> Ledger:
        """Take the directory lock (blocking); returns the :class:`Ledger`, reconciled after
        crashes (and with the shards of :meth:`recount_later` recounted). Pair with
        :meth:`release` (or use :meth:`locked`)."""
        self._tlock.acquire()
        try:
            if self._closed:
                raise OSError(errno.EBADF, "disk tier accounting file is closed", self.path)
            if self._fd < 0:
                self._open()  # OSError (EROFS, EACCES, ENOSPC, ...) goes to the caller
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                mm = self._mm
                if mm is None:
                    mm = self._mm = self._map()
                ledger = Ledger(self, mm)
                self._reconcile(ledger, mm)
                self._recount_pending(ledger)
            except BaseException:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            self._tlock.release()
            raise
        return ledger

    def release(self) -> None:
        """Give back the lock taken by :meth:`acquire`."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    @contextmanager
    def locked(self) -> Iterator[Ledger]:
        """Hold the directory lock; yields the :class:`Ledger` (reconciled after crashes)."""
        ledger = self.acquire()
        try:
            yield ledger
        finally:
            self.release()

    def generation(self) -> int | None:
        """The recount generation (read without locking; None before the file is mapped).

        Publishing protocol: read it, rename the record into place outside the lock, then under
        the lock add the record's bytes if the generation is unchanged, else recount the shard
        (a recount in between may or may not have counted the record).
        """
        mm = self._mm
        if mm is None:
            return None
        try:
            return int(_GEN.unpack_from(mm, _GEN_OFF)[0])
        except (ValueError, TypeError):  # closed meanwhile
            return None

    def try_account_publish(self, shard: int, nbytes: int, gen0: int, budget_bytes: int) -> bool:
        """Fast path of the publishing protocol: under the lock, count one published file of
        ``nbytes`` in ``shard`` when nothing needs repair (no dirty marker, generation still
        ``gen0``) and the directory stays within ``budget_bytes``. False (nothing changed):
        take the general path with :meth:`acquire` (also when a :meth:`recount_later` is due)."""
        self._tlock.acquire()
        try:
            mm = self._mm
            if mm is None or self._closed or self._pending:
                return False
            fd = self._fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                dirty, tb, tf, gen = _STATE.unpack_from(mm, _DIRTY_OFF)
                if dirty != DIRTY_NONE or gen != gen0 or tb + nbytes > budget_bytes:
                    return False
                off = _HEAD_LEN + _SLOT.size * shard
                b, f = _SLOT.unpack_from(mm, off)
                _DIRTY.pack_into(mm, _DIRTY_OFF, shard)  # stores in this order: see change()
                _SLOT.pack_into(mm, off, b + nbytes, f + 1)
                _TOTALS.pack_into(mm, _TOTALS_OFF, tb + nbytes, tf + 1)
                _DIRTY.pack_into(mm, _DIRTY_OFF, DIRTY_NONE)
                return True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    def peek(self) -> tuple[int, int]:
        """``(bytes, files)`` of the directory as last written, without locking (for stats)."""
        mm = self._mm
        if mm is None:
            return 0, 0
        try:
            b, f = _TOTALS.unpack_from(mm, _TOTALS_OFF)
        except (ValueError, TypeError):  # closed meanwhile
            return 0, 0
        return int(b), int(f)

    def snapshot(self) -> tuple[int, int]:
        """``(bytes, files)`` of the directory, read under the lock."""
        with self.locked() as led:
            return led.total_bytes, led.total_files


def read_accounting(root: str) -> tuple[int, int] | None:
    """``(bytes, files)`` recorded in ``root``'s accounting file without locking or changing
    anything; None when there is no readable file (for inspection tools)."""
    try:
        with open(f"{root}/{ACCT_NAME}", "rb") as f:
            data = f.read(ACCT_SIZE)
    except OSError:
        return None
    if len(data) < ACCT_SIZE or data[:8] != ACCT_MAGIC:
        return None
    slots = _SLOTS.unpack_from(data, _HEAD_LEN)
    return sum(slots[0::2]), sum(slots[1::2])
