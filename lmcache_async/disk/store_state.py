"""The disk store's bookkeeping: its index, counters and write stop/resume state.

:class:`StoreState` is the base of :class:`~lmcache_async.disk.store.DiskStore` that holds what
every file operation shares, all thread-safe:

* the in-memory index (digest -> file bytes, least recently used first) under ``_ilock``, with
  the removals remembered while a start-up scan runs (:meth:`StoreState.begin_scan`);
* the counters reported by ``stats()`` (:data:`COUNTERS`) and rate-limited warnings;
* the write stop/resume state: a storage error in :data:`WRITE_STOP_ERRNOS` stops writes for a
  back-off that doubles while retries keep failing;
* the listener told about entries the store drops on its own (:attr:`StoreState.on_removed`).

It does no file I/O of its own beyond the ``still_there`` check of
:meth:`StoreState._note_present`.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from lmcache_async.disk.budget import DirBudget
from lmcache_async.disk.layout import entry_path
from lmcache_async.lru import LruIndex
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.tiers import RemovalReason

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

__all__ = [
    "COUNTERS",
    "EXISTS",
    "FAILED",
    "NO_SPACE",
    "STORED",
    "WRITE_STOP_ERRNOS",
    "FsyncPolicy",
    "StoreState",
]

logger = logging.getLogger("lmcache_async.disk.tier")

FsyncPolicy = Literal["none", "data", "full"]

WRITE_STOP_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
"""Errors that stop writes for a back-off (disk full, quota, read-only, permission, too big)."""
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


class StoreState:
    """The shared state of a :class:`~lmcache_async.disk.store.DiskStore` (see the module
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
